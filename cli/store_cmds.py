"""``detjac run`` (prompts file -> store) and ``detjac store ls|info|verify|export``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

DTYPES = ("float64", "float32", "bfloat16")


@click.command()
@click.argument("model", type=click.Path())
@click.argument("prompts", type=click.Path())
@click.option("--out", "-o", required=True, type=click.Path(), help="Store folder (created, or resumed).")
@click.option("--dtype", type=click.Choice(DTYPES), default="float64", show_default=True,
              help="Compute dtype; bfloat16 results are stored as float32.")
@click.option("--row-block", type=click.IntRange(min=1), default=None,
              help="Jacobian rows per vmapped pullback and per stored chunk [default: 64, or sized to --max-memory].")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Refuse prompts longer than this many tokens (default: the model's context).")
@click.option("--keep", default="full", show_default=True,
              help="full: the whole Jacobian; rank:K: only the top-K singular triplets of each token's J_k and of "
                   "[J_1 ... J_n], sketched in one pass over the streamed rows (for long prompts or big models).")
@click.option("--ordinary", is_flag=True,
              help="Store the ordinary Jacobian (nothing detached; it does not reconstruct the output), "
                   "for comparison with the detached one.")
@click.option("--layers", default=None,
              help="Also store layerwise Jacobians of these layers: all, or indices like 0,5,10 (negative counts "
                   "from the end). Implies --streamed.")
@click.option("--components", default="layer", show_default=True,
              help="With --layers: layer (the layer's output), attn, mlp (its attention / MLP contributions), "
                   "w.r.t. the input embeddings; add _local (layer_local, attn_local, mlp_local) for the same "
                   "w.r.t. the layer's own input.")
@click.option("--streamed", is_flag=True,
              help="Use the layer-streamed engine: one decoder layer's weights in memory at a time, read from "
                   "the checkpoint (for models larger than memory). Implied by --layers, --max-memory, --quantize.")
@click.option("--max-memory", default=None,
              help="Memory budget per device for the streamed engine, e.g. cpu=4GiB or cuda:0=8GiB,cpu=32GiB; "
                   "the row block is sized to fit.")
@click.option("--quantize", type=click.Choice(("nf4", "fp4", "int8")), default=None,
              help="Quantize a float checkpoint on load with bitsandbytes (pip install 'detjac[quant]'); the "
                   "Jacobian is that of the quantized model. bitsandbytes checkpoints are read as they are.")
@click.option("--mode", type=click.Choice(("auto", "reverse", "forward")), default="auto", show_default=True,
              help="Streamed engine: reverse (row blocks, vjp) or forward (token blocks, jvp) sweeps; auto picks "
                   "the cheaper by the cost model (see README).")
@click.option("--force-new", is_flag=True, help="Replace a store written for another model or settings.")
@click.option("--device", default="cpu", show_default=True, help="Torch device, e.g. cuda:0.")
@click.option("--revision", default=None, help="Checkpoint revision (for from_pretrained).")
@click.option("--trust-remote-code", is_flag=True, help="Allow the checkpoint's own Python code (off by default).")
def run(model: str, prompts: str, out: str, **settings: Any) -> None:
    """Detached Jacobians of MODEL on every prompt of PROMPTS, streamed into a store.

    PROMPTS is a .txt file (one prompt per line) or a .jsonl file ({"prompt": ...} or
    {"text": ...} per line, other fields kept as metadata); blank lines are skipped. MODEL is a checkpoint
    folder or `default`. Each prompt's row blocks go to disk as they are computed and the
    prompt becomes visible only when complete. Re-running the same command after a crash
    or kill resumes: complete prompts are skipped, partial ones redone. Duplicate prompts
    are stored once.

    \b
    Examples:
      detjac run default prompts.txt --out run.zarr
      detjac run ./Llama-3.2-1B prompts.jsonl --out llama.zarr --dtype float32 --row-block 128
      detjac run default long_prompts.txt --out lowrank.zarr --keep rank:16
      detjac run default prompts.txt --out ordinary.zarr --ordinary
      detjac run default prompts.txt --out layers.zarr --layers all --components layer,attn,mlp
      detjac run ./Qwen3-14B prompts.txt --out q.zarr --dtype bfloat16 --device cuda:0 --max-memory cuda:0=8GiB
      detjac run ./Llama-3.1-70B prompts.txt --out l.zarr --dtype bfloat16 --device cuda:0 --quantize nf4
    """
    from .batch import parse_keep

    parse_keep(settings["keep"])
    settings["detach"] = not settings.pop("ordinary")
    _run(model, prompts, out, **settings)


def _run(model_arg: str, prompts_path: str, out: str, *, dtype: str, row_block: int | None, max_tokens: int | None,
         keep: str, detach: bool, layers: str | None, components: str, streamed: bool, max_memory: str | None,
         quantize: str | None, mode: str, force_new: bool, device: str, revision: str | None,
         trust_remote_code: bool) -> None:
    import torch
    from tqdm.auto import tqdm

    from detjac.engine.default import resolve_model
    from detjac.errors import InvalidArgumentError
    from detjac.store import create_store, prompt_id

    from .batch import RunSummary, read_prompts, run_description, tokenize_all, write_prompt, write_streamed_prompt

    streamed = streamed or bool(layers or max_memory or quantize)
    if layers is None and components != "layer":
        raise InvalidArgumentError(f"Expected --layers with --components. Got --components {components} alone.")
    if layers is not None and keep != "full":
        raise InvalidArgumentError(f"Expected --keep full with --layers (layerwise Jacobians are stored whole). "
                                   f"Got --keep {keep}.")
    if not streamed and mode != "auto":
        raise InvalidArgumentError(f"Expected --mode with the streamed engine (--streamed). Got --mode {mode} alone.")
    prompts = read_prompts(prompts_path)
    source = resolve_model(model_arg)
    targets: list[Any] = []
    if streamed:
        from detjac.engine.streamed import StreamedModel, layer_targets

        model = StreamedModel(source, dtype=getattr(torch, dtype), device=device, detach=detach,
                              max_memory=max_memory, quantize=quantize, revision=revision,
                              trust_remote_code=trust_remote_code)
        tok, prompt_model = model.tokenizer, model.prompt_model()
        targets = layer_targets(layers, components, model.n_layers) if layers is not None else []
    else:
        from detjac.engine import get_tokenizer, load_model

        model = load_model(source, dtype=getattr(torch, dtype), device=device, revision=revision,
                           trust_remote_code=trust_remote_code)
        tok = get_tokenizer(model)
        prompt_model = model
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 2**31
    limit = min(max_tokens or context, context)
    ids = tokenize_all(prompts, prompt_model, tok, limit)
    run_attrs = run_description(model, model_arg, Path(source) if Path(source).is_dir() else None, revision,
                                dtype, row_block or ("auto" if max_memory else 64), limit, keep, detach)
    if streamed:
        run_attrs.update({"engine": "streamed", "layerwise": [t.name for t in targets], "quantize": quantize,
                          "mode": mode, "max_memory": max_memory})
    todo: dict[str, tuple[Any, list[int]]] = {}
    summary = RunSummary(blank_lines=prompts.blank)
    for item, tokens in zip(prompts.prompts, ids, strict=True):
        pid = prompt_id(run_attrs, item.text)
        if pid in todo:
            summary.duplicates += 1
        else:
            todo[pid] = (item, tokens)
    with create_store(out, run_attrs, force_new=force_new,
                      model_data=lambda: _model_for_decoding(model, source, dtype)) as store:
        done = set(store.prompt_ids())
        summary.skipped_complete = sum(pid in done for pid in todo)
        pending = [(pid, v) for pid, v in todo.items() if pid not in done]
        what = f" and {len(targets)} layerwise Jacobians per prompt" if targets else ""
        click.echo(f"{len(prompts.prompts)} prompts in {prompts_path} ({prompts.blank} blank lines skipped, "
                   f"{summary.duplicates} duplicates); {summary.skipped_complete} already in {out}; "
                   f"{len(pending)} to compute{what}.")
        with tqdm(total=len(pending), desc="prompts", unit="prompt") as outer, \
                tqdm(desc="blocks", unit="block", leave=False) as inner:
            for pid, (item, tokens) in pending:
                if streamed:
                    error = write_streamed_prompt(store, model, pid, item, tokens, run_attrs, targets, inner)
                else:
                    error = write_prompt(store, model, tok, pid, item, tokens, run_attrs, inner)
                summary.written += 1
                summary.worst_error = max(summary.worst_error, error)
                outer.set_postfix(error=f"{error:.1e}")
                outer.update()
        total = len(store.prompt_ids())
    click.echo(f"done: {summary.written} written, {summary.skipped_complete} already complete, "
               f"{summary.duplicates} duplicates, {summary.blank_lines} blank lines; {total} prompts in {out}; "
               f"worst reconstruction error this run {summary.worst_error:.2e}")


def _model_for_decoding(model: Any, source: Any, dtype: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The embedding and unembedding matrices, the final norm's gain and the tokenizer file, kept in the store
    for decoding."""
    import torch

    from detjac.engine.decode import final_norm_gain

    from .batch import storage_dtype

    storage = getattr(torch, storage_dtype(dtype))
    if hasattr(model, "decoding_matrices"):  # the streamed engine reads them from the checkpoint
        arrays = model.decoding_matrices(storage)
    else:
        from detjac.engine import decoding_matrix

        arrays = {"embedding": model.get_input_embeddings().weight, "unembedding": decoding_matrix(model)}
        gain = final_norm_gain(model)
        if gain is not None:
            arrays["final_norm"] = gain
    arrays = {k: v.detach().to(device="cpu", dtype=storage).numpy() for k, v in arrays.items()}
    tok_file = Path(source) / "tokenizer.json" if Path(source).is_dir() else None
    files = {"tokenizer.json": tok_file.read_bytes()} if tok_file is not None and tok_file.is_file() else {}
    return arrays, files


@click.group()
def store() -> None:
    """Inspect a store written by `detjac run`: ls, info, verify, export.

    \b
    Examples:
      detjac store ls run.zarr --contains "cat"
      detjac store info run.zarr
      detjac store verify run.zarr
      detjac store export run.zarr 3f2a9c0d1e2b4a5f --out prompt.npz
    """


@store.command("ls")
@click.argument("path", type=click.Path())
@click.option("--contains", default=None, help="Only prompts whose text contains this.")
def ls(path: str, contains: str | None) -> None:
    """List the complete prompts: id, tokens, reconstruction error, next token, text.

    \b
    Example:
      detjac store ls run.zarr --contains "Oak"
    """
    from detjac.store import open_store

    st = open_store(path)
    for p in st.prompts(contains=contains):
        a = p.attrs
        click.echo(f"{p.id}  {a['n_tokens']:>4} tok  err {a['reconstruction_error']:.1e}  "
                   f"next {a.get('next_token')!r:<12} {a['prompt'][:70]!r}")


@store.command()
@click.argument("path", type=click.Path())
@click.argument("prompt_id", required=False)
def info(path: str, prompt_id: str | None) -> None:
    """The run's description and counts, or one prompt's metadata.

    \b
    Examples:
      detjac store info run.zarr
      detjac store info run.zarr 3f2a9c0d1e2b4a5f
    """
    from detjac.store import open_store

    st = open_store(path)
    if prompt_id is not None:
        prompt = st.get(prompt_id)
        click.echo(json.dumps(prompt.attrs, indent=2, ensure_ascii=False))
        if prompt.low_rank:
            U, S, V = prompt.triplets()
            click.echo(f"low rank: combined U {U.shape}, S {S.shape}, V {V.shape}; per-token triplets of rank "
                       f"{S.shape[0]} for {prompt.n_tokens} tokens")
        else:
            arr = prompt.jacobian()
            click.echo(f"jacobian {tuple(arr.shape)} {arr.dtype}, chunks {arr.chunksize}")
        return
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    click.echo(f"store {path}: format version {st.format_version}, created {st.created}")
    click.echo(json.dumps(st.run, indent=2, ensure_ascii=False))
    leftovers = st.staging_leftovers()
    click.echo(f"{len(st)} complete prompts, {size / 2**20:.1f} MiB on disk"
               + (f"; {len(leftovers)} partial prompts in staging (redone on the next run)" if leftovers else ""))


@store.command()
@click.argument("path", type=click.Path())
def verify(path: str) -> None:
    """Re-read every complete prompt: chunk checksums and sum_k J_k x_k against the stored output.

    Exits with status 1 if any prompt is corrupt, naming each.

    \b
    Example:
      detjac store verify run.zarr
    """
    from detjac.store import open_store

    results = open_store(path).verify(progress=True)
    bad = [r for r in results if not r.ok]
    for r in bad:
        click.echo(f"CORRUPT {r.id}: {r.reason}")
    worst = max((r.reconstruction_error for r in results if r.ok and r.reconstruction_error is not None), default=0.0)
    click.echo(f"{len(results) - len(bad)} of {len(results)} prompts ok (worst reconstruction error {worst:.2e}); "
               f"{len(bad)} corrupt")
    if bad:
        raise SystemExit(1)


@store.command()
@click.argument("path", type=click.Path())
@click.argument("prompt_id")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="Output .npz file.")
def export(path: str, prompt_id: str, out: str) -> None:
    """Write one prompt's arrays and metadata to a numpy .npz file (no pickles).

    \b
    Example:
      detjac store export run.zarr 3f2a9c0d1e2b4a5f --out prompt.npz
    """
    import numpy as np

    from detjac.store import open_store

    prompt = open_store(path).get(prompt_id)
    arrays = {name: prompt.array(name) for name in ("embeddings", "output", "token_ids")}
    if prompt.bias() is not None:
        arrays["bias"] = prompt.bias()
    if prompt.low_rank:
        arrays.update({f"combined_{x}": a for x, a in zip("USV", prompt.triplets(), strict=True)})
        arrays.update({name: prompt.array(name) for name in ("token_U", "token_S", "token_V", "token_frobenius_sq")})
    else:
        arrays["jacobian"] = prompt.jacobian(lazy=False)
    np.savez(out, attrs=np.array(json.dumps(prompt.attrs)), **arrays)
    click.echo(f"wrote {out}")
