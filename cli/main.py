"""``detjac`` command line. Heavy imports (torch, transformers) happen inside commands."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from detjac import __version__
from detjac.errors import DetjacError
from detjac.model_settings import LoadSpec

from .analyze_cmds import analyze
from .attention_cmd import attention
from .graph_cmd import graph
from .lens_cmd import lens
from .neurons_cmd import neurons
from .options import (
    ROW_BLOCK_HELP,
    check_out,
    model_argument,
    model_options,
    model_reads,
    out_option,
    prompt_options,
)
from .run_cmd import run
from .steer_cmd import steer
from .store_cmds import store
from .svd_cmd import svd
from .view_cmd import view
from .views_cmds import VIEW_COMMANDS

if TYPE_CHECKING:
    from detjac.engine import ModelRef

# Read by PyTorch's CPU allocator at its first allocation (so before torch is imported): buffers of 2 MiB and
# more get transparent huge pages where the kernel allows them (THP "madvise" or "always"). The sweeps allocate
# and free large cotangent buffers in every layer; with 4 KiB pages each new one costs a page fault per page
# (measured: a 128-token reverse block took 1.1 million faults and ~15% longer). THP_MEM_ALLOC_ENABLE=0 turns
# it off; worker processes a run starts inherit it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# numpy's OpenBLAS (read when numpy is first imported, after this) runs every LAPACK call on one thread per core, and
# its idle threads spin: the small SVDs of `analyze svd`, `view` and a prompt's operators paid for it. Measured on 2
# cores shared with other jobs, a 256 x 1536 SVD took 0.07 s of CPU (0.8 s wall) on one thread and 1.9-2.7 s of CPU
# (17-29 s wall) on two. The store's larger analyses run in dask's threads, one BLAS thread each (dask's own advice).
# torch (MKL) is not affected; OPENBLAS_NUM_THREADS set by the user is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")




class DetjacGroup(click.Group):
    """Turns every :class:`DetjacError` into a one-line message and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DetjacError as e:
            click.secho(f"Error: {e}", fg="red", err=True)
            sys.exit(1)


@click.group(cls=DetjacGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="detjac")
def main() -> None:
    """Exact detached Jacobians of language models.

    \b
    Examples:
      detjac jacobian meta-llama/Llama-3.2-1B --prompt "The bridge out of Marin is the"   # from the HF cache
      detjac svd meta-llama/Llama-3.2-1B --prompt-file long.txt --k 16
      detjac demo
      detjac run default prompts.txt --out run.zarr
      detjac store verify run.zarr
      detjac analyze svd run.zarr --k 3
      detjac view run.zarr
      detjac steer default --concept-from c.zarr:PROMPT_ID --layer 1 --prompt "Ream, n. A"
      detjac families --check
    """


@main.command()
@model_argument()
@prompt_options()
@model_options()
@click.option("--row-block", type=click.IntRange(min=1), default=None, help=ROW_BLOCK_HELP)
@click.option("--k", "n_values", type=click.IntRange(min=1), default=5, show_default=True,
              help="Singular values of the summed operator to show (one line each).")
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True,
              help="Decoded tokens per singular vector (left and right share a line, so fewer than demo's).")
@click.option("--ordinary/--no-ordinary", default=True, show_default=True,
              help="Also compute the ordinary Jacobian, whose reconstruction error (order 1) is the contrast that "
                   "shows the detached one is exact. It goes through torch.func: in memory more than twice the "
                   "detached pass's time (a line says so before it starts), layer-streamed less than twice; "
                   "--no-ordinary skips it.")
@out_option("Also save the Jacobian: FILE.npz (jacobian, embeddings, output, token_ids, tokens, ...), or a store "
            "folder (created or resumed, as `detjac run` writes it).",
            check=lambda out, force: _check_jacobian_out(out, force))
def jacobian(model: ModelRef, prompt: str, model_options: LoadSpec, row_block: int | None, n_values: int, top: int,
             ordinary: bool, out: str | None, force: bool) -> None:
    """Detached Jacobian of MODEL on one prompt.

    MODEL is a local Hugging Face checkpoint folder, a hub id (org/name, read from the Hugging
    Face cache, or downloaded into it when online; `hf download org/name` fetches it ahead),
    a GGUF file (its weights dequantized to --dtype: the Jacobian is exact for the
    dequantized model, not for the bf16 model it was quantized from), or `default` (also
    when omitted) for the shipped default model.

    Prints the prompt tokens, the predicted next token, the reconstruction error of the
    detached and of the ordinary Jacobian, and the top singular values of the summed
    operator sum_k J_k with the tokens its singular vectors decode to (left vectors
    through the unembedding, right vectors through the input embedding).

    The ordinary Jacobian is computed by default (--ordinary): its reconstruction error, of
    order 1, is the contrast that shows the detached one is exact. It has no explicit pieces:
    it goes through torch.func, which costs more than the detached pass by its explicit
    pieces: measured 2.5 times on the shipped model in memory, 1.9 times layer-streamed, and
    1.7 times layer-streamed at the Llama-3.2-1B shape under cpu=1GiB (289 s and 483 s, 17
    tokens, float32; benchmarks.ordinary_cost). In memory, where it costs more than twice,
    a line on stderr says so before the work starts; --no-ordinary skips it. Each pass
    shows its own labelled progress bar.

    \b
    Examples:
      detjac jacobian --prompt "Kitten, n. A young"            # the default model
      detjac jacobian meta-llama/Llama-3.2-1B --prompt "The bridge out of Marin is the" --row-block 128
      detjac jacobian ./my-checkpoint --prompt "..."           # a folder saved by save_pretrained
      detjac jacobian SmolLM2-135M-Instruct.Q4_1.gguf -p "The bridge out of Marin is the"
      detjac jacobian org/name-GGUF --gguf-file model.Q4_K_M.gguf -p "..."   # one GGUF of a hub repository
      detjac jacobian -p "Kitten, n. A young" --out kitten.npz  # numpy.load("kitten.npz")["jacobian"]
      detjac jacobian -p "Kitten, n. A young" --out kitten.zarr # a store: detjac store ls kitten.zarr
      detjac jacobian -p "Kitten, n. A young" --streamed        # one layer in memory at a time
      detjac jacobian -p "Kitten, n. A young" --no-ordinary     # the detached Jacobian alone
    """
    from detjac.runs import prompt_jacobian

    from .render import piece

    if out is not None:  # again, now that MODEL is resolved: not into what it reads
        _check_jacobian_out(out, force, model)
    outcome = prompt_jacobian(model_options, model, prompt, row_block=row_block, ordinary=ordinary,
                              n_values=n_values, top=top, out=out, force=force,
                              note=lambda line: click.echo(line, err=True))
    engine, rep, summed = outcome.engine, outcome.report, outcome.summed
    tok, res = engine.tokenizer, rep.detached
    click.echo(f"model       {model.name} ({res.family}, {model_options.dtype}; target: position {res.position})")
    click.echo(f"tokens      {len(res.token_ids)}: " + " ".join(piece(tok, i) for i in res.token_ids))
    probs = res.logits.softmax(-1)
    encoder = engine.family.encoder  # no LM head: scores against the word embeddings
    label, left = ("top token  ", "word embeddings") if encoder else ("next token ", "unembedding")
    click.echo(f"{label} {piece(tok, res.next_token_id)} (id {res.next_token_id}, "
               f"p={float(probs[res.next_token_id]):.3f}); reconstruction argmax "
               f"{'agrees' if rep.argmax_agrees else 'DIFFERS'}")
    contrast = f"{rep.ordinary.reconstruction_error:.3e}" if rep.ordinary else "not computed (--no-ordinary)"
    click.echo(f"reconstruction error  detached {res.reconstruction_error:.3e}   ordinary {contrast}")
    click.echo(f"max |logit - stock logit|  {rep.stock_logit_diff:.3e}   ({rep.seconds:.2f} s)")
    click.echo("top singular values of sum_k J_k, with decoded tokens:")
    click.echo(f"  {'#':>2}  {'sigma':>10}  left ({left}) | right (embedding)")
    for i, s in enumerate(summed.singular_values.tolist()):
        left = " ".join(piece(tok, t) for t in summed.left_ids[i].tolist())
        right = " ".join(piece(tok, t) for t in summed.right_ids[i].tolist())
        click.echo(f"  {i + 1:>2}  {s:>10.4g}  {left} | {right}")
    if outcome.written is not None:
        click.echo(f"wrote {outcome.written}")
    elif outcome.stored is not None:
        click.echo(f"stored as prompt {outcome.stored} in {out}")


def _check_jacobian_out(out: str, force: bool, model: ModelRef | None = None) -> None:
    """``jacobian --out``: a .npz file, or else a store folder (created or resumed), not into MODEL's files."""
    npz = out.lower().endswith(".npz")
    check_out(out, force=force, kind="file" if npz else "store", suffix=".npz" if npz else None,
              reads=model_reads(model))


@main.command()
@click.option("--check", is_flag=True,
              help="Also run each family's exactness check on a tiny random model (float64, offline, seconds).")
@click.option("--tokens", type=click.IntRange(min=2, max=64), default=12, show_default=True,
              help="Prompt length for --check (longer than the tiny models' sliding window of 4).")
def families(check: bool, tokens: int) -> None:
    """List the supported model families and their detach rules.

    With --check, each family's tiny random model (d_model=32, 3 layers) is linearized and
    the float64 reconstruction error of the detached and of the ordinary Jacobian, the
    largest logit difference to the unmodified model and the argmax agreement are shown,
    then the detached error for float32 and bfloat16.

    \b
    Examples:
      detjac families
      detjac families --check --tokens 16
    """
    from detjac.engine import FAMILIES

    seen: set[str] = set()
    for family in FAMILIES.values():
        if family.name in seen:
            continue
        seen.add(family.name)
        click.echo(f"{family.name} (model_type: {', '.join(family.model_types)})")
        for line in family.describe():
            click.echo(f"    {line}")
    if check:
        _family_check(tokens)


def _family_check(tokens: int) -> None:
    from detjac.runs import family_checks

    click.echo(f"\nTiny random models (d_model=32, 3 layers, window 4), prompt of {tokens} random tokens, float64.")
    click.echo(f"{'family':<12} {'detached err':>13} {'ordinary err':>13} {'|logit-stock|':>14} "
               f"{'argmax':>7} {'time':>7}")
    families, dtypes = family_checks(tokens)
    for model_type, rep in families:
        click.echo(f"{model_type:<12} {rep.detached.reconstruction_error:>13.2e} "
                   f"{rep.ordinary.reconstruction_error:>13.2e} {rep.stock_logit_diff:>14.2e} "  # type: ignore[union-attr]
                   f"{'same' if rep.argmax_agrees else 'DIFF':>7} {rep.seconds:>6.2f}s")
    click.echo("\nOther dtypes (llama), detached reconstruction error:")
    for dt, rep in dtypes:
        click.echo(f"  {dt:<9} {rep.detached.reconstruction_error:.2e}")


@main.command()
@model_argument()
@prompt_options(required=False, multiple=True)
@click.option("--plot", type=click.Path(dir_okay=False), default="detjac-demo-spectra.png", show_default=True,
              help="Where to write the singular value spectra (.png, .svg or .pdf).")
@click.option("--k", "n_values", type=click.IntRange(min=1, max=20), default=3, show_default=True,
              help="Singular triplets of the combined operator to decode (fewer than jacobian's: the demo decodes "
                   "them for every token too).")
@click.option("--top", type=click.IntRange(min=1, max=50), default=8, show_default=True,
              help="Decoded tokens per singular vector (left and right each get a line).")
@model_options()
def demo(model: ModelRef, prompt: tuple[str, ...], plot: str, n_values: int, top: int,
         model_options: LoadSpec) -> None:
    """The main job on the shipped default model, offline: a small Llama trained on a dictionary
    (or on MODEL: a checkpoint folder, a hub id or a GGUF file).

    For each prompt: the tokens, the predicted next token, the float64 reconstruction error
    of the detached Jacobian (and of the ordinary one, for contrast), the top singular values
    of the combined operator [J_1 ... J_n] and of each token's J_k, and the tokens their
    leading left (through the unembedding) and right (through the input embedding) singular
    vectors decode to. Writes the singular value spectra to --plot.

    \b
    Examples:
      detjac demo
      detjac demo -p "Harp, n. (Mus.) A stringed instrument" --plot harp.png --top 10
      detjac demo SmolLM2-135M-Instruct.Q4_1.gguf -p "The bridge out of Marin is the"
    """
    from detjac.analysis import SpectrumPanel, plot_spectra
    from detjac.engine import DEFAULT_MODEL_DIR, load_engine
    from detjac.runs import demo_prompts

    from .render import echo_explanation, echo_prediction, piece

    source, o, prompts = model.name, model_options, prompt
    if source != "default" and not prompts:
        raise click.UsageError("Expected --prompt with a MODEL other than default: the built-in prompts are "
                               "dictionary entries for the default model.")
    check_out(plot, force=True, reads=model_reads(model))  # replaced as always, never into MODEL or a store
    engine = load_engine(o)
    tok = engine.tokenizer
    n_params = engine.parameter_count()
    where = f"{o.dtype}, {'CPU' if o.device == 'cpu' else o.device}" + (", streamed" if o.streamed_engine else "")
    if source == "default":
        click.echo(f"default model: {DEFAULT_MODEL_DIR.name} (Llama, {n_params:,} parameters, trained on the GCIDE "
                   f"dictionary; model card: {DEFAULT_MODEL_DIR / 'README.md'}), {where}")
    else:
        click.echo(f"model: {source} ({engine.family.name}, {n_params:,} parameters), {where}")
    panels = []
    for i, done in enumerate(demo_prompts(engine, prompts, n_values=n_values, top=top), start=1):
        prompt, rep, expl = done.text, done.report, done.explanation
        res = rep.detached
        click.echo(f"\n[{i}] {prompt!r}")
        echo_prediction(res, tok, rep.stock_logit_diff)
        ordinary = rep.ordinary.reconstruction_error  # type: ignore[union-attr]
        click.echo(f"  (the ordinary, non-detached Jacobian reconstructs with error {ordinary:.2e})")
        echo_explanation(expl, tok)
        labels = [piece(tok, t) for t in res.token_ids]
        short = prompt if len(prompt) <= 48 else prompt[:45] + "..."
        title = f"[{i}] {short!r}\nnext token {piece(tok, res.next_token_id)}"
        panels.append(SpectrumPanel(title, expl.combined.spectrum.tolist(),
                                    {f"{k}:{lab}": op.spectrum.tolist()
                                     for k, (lab, op) in enumerate(zip(labels, expl.per_token, strict=True))}))
    name = "default" if source == "default" else Path(source).name
    path = plot_spectra(panels, plot, suptitle=f"Singular values of the detached Jacobian ({name} model)")
    click.echo(f"\nwrote singular value spectra to {path.resolve()}")


main.add_command(run)
main.add_command(store)
main.add_command(analyze)
for _view in VIEW_COMMANDS:  # analyze columns | image | path
    analyze.add_command(_view)
main.add_command(steer)
main.add_command(svd)
main.add_command(graph)
main.add_command(attention)
main.add_command(view)
main.add_command(lens)
main.add_command(neurons)

if __name__ == "__main__":  # pragma: no cover
    main()
