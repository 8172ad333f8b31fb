"""``detjac lens fit|save|apply|evaluate``: the detached Jacobian lens, fitted from a store's to_output targets.

Each command parses, calls one function of :mod:`detjac.analysis.lens.lens_fit`, :mod:`detjac.analysis.lens` or
:mod:`detjac.runs.lens_apply`, and prints what it returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from detjac.model_settings import LoadSpec

from . import render
from .options import (
    check_results,
    cluster_options,
    collect_model_options,
    gguf_file_option,
    model_option,
    model_ref_option,
    prompt_options,
    resolve_model_ref,
)

if TYPE_CHECKING:
    from detjac.engine import ModelRef
    from detjac.runs import ClusterOptions


@click.group()
def lens() -> None:
    """The detached Jacobian lens: per layer L, the mean over a store's prompts of dy_p/dh_{L,p} (the same-position
    block of the stored to_output.L Jacobian), decoded beside the logit lens.

    \b
    Examples:
      detjac run default prompts.txt --out fit.zarr --layers all --components to_output
      detjac lens fit fit.zarr --workers 2
      detjac lens save fit.zarr gcide.lens
      detjac lens apply gcide.lens --prompt "Oak, n. A tree of the genus" --plot oak.png
      detjac lens evaluate gcide.lens --ordinary ordinary.zarr --limit 300 --out eval/
      detjac lens export gcide.lens gcide.pt    # the reference's artifact format (the lens records its model)
    """


def _layers(value: str | None) -> list[int] | None:
    """``--layers``, read by :func:`detjac.targets.parse_layers` (None: all)."""
    from detjac.errors import InvalidArgumentError
    from detjac.targets import parse_layers

    try:
        return None if value is None else parse_layers(value)
    except InvalidArgumentError as exc:
        raise click.BadParameter(str(exc)) from None


@lens.command("fit")
@click.argument("path", type=click.Path())
@click.option("--layers", default="all", show_default=True, help="all, or stored layers like 0,2,-1.")
@click.option("--chunk", type=click.IntRange(min=1), default=32, show_default=True,
              help="Prompts per task; each task commits its partial sums, so a killed fit resumes from them.")
@click.option("--estimator", type=click.Choice(["same-position", "jlens"]), default="same-position",
              show_default=True,
              help="same-position: the mean of a store's dy_p/dh_{L,p}. jlens: Gurnee et al.'s estimator, computed "
                   "from --model on --prompts and saved as the lens folder PATH.")
@model_ref_option(default=None, help="With --estimator jlens: the model (a folder, hub id, GGUF file or default).")
@gguf_file_option
@click.option("--prompts", "prompts_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="With --estimator jlens: the texts, one per line.")
@click.option("--ordinary", is_flag=True, help="With --estimator jlens: ordinary Jacobians (nothing detached).")
@click.option("--force", is_flag=True, help="With --estimator jlens: replace the lens folder PATH if it exists.")
@click.option("--bos/--no-bos", default=True, show_default=True,
              help="With --estimator jlens: put the tokenizer's BOS token first when it does not (as TransformerLens' "
                   "fit does).")
@model_option("device", default=None, show_default=False,
              help="With --estimator jlens: the torch device the model runs on, e.g. cuda:0 [default: cpu].")
@cluster_options(memory_limit="2GiB", work="the computation")
def fit_cmd(path: str, layers: str, chunk: int, estimator: str, model: str | None, gguf_file: str | None,
            prompts_path: str | None, ordinary: bool, force: bool, bos: bool, device: str | None,
            cluster: ClusterOptions) -> None:
    """Fit the lens of a store with to_output targets and keep it in the store (lens/fitted).

    Per layer: the mean of the prompts' same-position operators, their element-wise second moment and
    the count. A Dask reduction, one task per layer and chunk of prompts; run it again after a kill to
    resume (prompts already summed are not read again).

    With --estimator jlens, the estimator of Gurnee et al. instead, computed from MODEL on the texts of
    --prompts (float64, layer-streamed) and saved as a lens folder PATH: per text, the mean over source
    positions k of sum_{p' >= k} dy_p'/dh_{L,k} (every later position's final state; the first 16 positions
    and the last left out, texts cut at 128 tokens), then the mean over texts. `lens apply` and `lens
    evaluate` read it like any saved lens.

    \b
    Examples:
      detjac lens fit fit.zarr
      detjac lens fit fit.zarr --layers 0,-1 --workers 2
      detjac lens fit /shared/fit.zarr --scheduler tcp://10.0.0.5:8786
      detjac lens fit texts.jlens --estimator jlens --model default --prompts texts.txt
      detjac lens fit texts-ordinary.jlens --estimator jlens --ordinary --model default --prompts texts.txt
      detjac lens fit big.jlens --estimator jlens --model ./Llama-3.1-70B --prompts texts.txt --device cuda:0
    """
    if estimator == "jlens":
        _fit_jlens(path, layers, model, gguf_file, prompts_path, ordinary, force, bos, device or "cpu")
        return
    given = [name for name, value in (("--model", model), ("--gguf-file", gguf_file), ("--prompts", prompts_path),
                                      ("--ordinary", ordinary), ("--force", force), ("--no-bos", not bos),
                                      ("--device", device))
             if value]
    if given:
        raise click.UsageError(f"Expected {', '.join(given)} only with --estimator jlens (the same-position lens is "
                               "fitted from the store PATH).")
    from detjac.analysis import fit_lens, load_lens, relative_spread
    from detjac.progress import tqdm
    from detjac.runs import dask_cluster
    from detjac.store import open_store

    store = open_store(path)
    with dask_cluster(cluster, log=click.echo):
        report = fit_lens(store, _layers(layers), chunk=chunk,
                          progress=lambda total: tqdm(total=total, desc="lens fit", unit="task"))
    fitted = load_lens(path)
    click.echo(f"{fitted.kind} lens of {fitted.info['n_prompts']} prompts, layers "
               f"{', '.join(map(str, report['layers']))}: {report['tasks']} tasks now, "
               f"{report['reused']} prompt-layers from earlier partial sums; written to {path}/lens/fitted")
    for layer, spread in zip(fitted.layers, relative_spread(fitted), strict=True):
        click.echo(f"  layer {layer}: relative spread sum(Var T_p) / ||mean||_F^2 = {spread:.3g}")


def _fit_jlens(path: str, layers: str, model: str | None, gguf_file: str | None, prompts_path: str | None,
               ordinary: bool, force: bool, bos: bool = True, device: str = "cpu") -> None:
    """``lens fit --estimator jlens``: the lens of the texts, computed from the model, saved at ``path``."""
    from detjac.analysis import relative_spread
    from detjac.runs import fit_jlens_folder

    if model is None or prompts_path is None:
        raise click.UsageError("Expected --model and --prompts with --estimator jlens (it runs the model on the "
                               "texts).")
    fitted, written, chosen = fit_jlens_folder(path, prompts_path, model, gguf_file=gguf_file, layers=_layers(layers),
                                               ordinary=ordinary, force=force, bos=bos, device=device)
    click.echo(f"{fitted.kind} jlens lens of {fitted.info['n_prompts']} texts ({fitted.info['skipped_prompts']} "
               f"too short), layers {', '.join(map(str, chosen))}: written to {written}")
    for layer, spread in zip(fitted.layers, relative_spread(fitted), strict=True):
        click.echo(f"  layer {layer}: relative spread sum(Var) / ||mean||_F^2 = {spread:.3g}")


@lens.command("save")
@click.argument("path", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--force", is_flag=True, help="Replace OUT if it is a saved lens (never a store or another folder).")
def save_cmd(path: str, out: str, force: bool) -> None:
    """Save the fitted lens of a store by itself (a small zarr folder) to share it.

    \b
    Example:
      detjac lens save fit.zarr gcide.lens
    """
    from detjac.analysis import check_lens_target, save_lens
    from detjac.runs import read_lens

    check_lens_target(out, force, reads=[("the lens", path)])  # not into what is read
    written = save_lens(read_lens(path), out, force=force)
    click.echo(f"wrote {written}")


def _lenses(lens_path: str, ordinary: str | None) -> dict:
    """The lenses of ``lens apply/evaluate`` by role: LENS_PATH's named by its kind (a published lens is one of
    ordinary Jacobians), and the --ordinary one; both checked to be of the kind their role names."""
    from detjac.runs import check_lens_kinds, read_lens

    first = read_lens(lens_path)
    lenses = {f"{first.kind} lens": first}
    if ordinary:
        if first.kind == "ordinary":
            raise click.UsageError(f"Expected --ordinary beside a lens of detached Jacobians. Got {lens_path}, a lens "
                                   "of ordinary Jacobians itself.")
        lenses["ordinary lens"] = read_lens(ordinary)
    check_lens_kinds(lenses)  # before the model loads
    return lenses


@lens.command("export")
@click.argument("lens_path", type=click.Path())
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--dtype", type=click.Choice(["float16", "float32"]), default="float16", show_default=True,
              help="The matrices' dtype in the file (the reference's default is float16).")
@model_ref_option(default=None,
                  help="The model the lens was fitted on (a folder, hub id, GGUF file or default) [default: the one "
                       "the lens records]: read for a lens onto the final normed state (its rows are divided by the "
                       "final norm's gain) or one that does not record the model's layer count.")
@gguf_file_option
@click.option("--force", is_flag=True, help="Replace OUT if it is a file.")
def export_cmd(lens_path: str, out: str, dtype: str, model: str | None, gguf_file: str | None, force: bool) -> None:
    """Write a lens in the Jacobian-lens artifact format of the reference implementation and TransformerLens
    (`JacobianLens.load`): one torch file {J, n_prompts, source_layers, d_model, metadata}, readable with
    torch.load(weights_only=True); detjac's provenance under metadata["detjac"]. The last layer is left out
    (the format's transport there is the identity).

    \b
    Examples:
      detjac lens export texts.jlens texts.pt
      detjac lens export fit.zarr gcide.pt --model default --dtype float32
    """
    from detjac.runs import export_lens_file

    done = export_lens_file(lens_path, out, dtype=dtype, model=model, gguf_file=gguf_file, force=force)
    layers = done.layers
    click.echo(f"{done.lens.kind} {done.lens.info.get('estimator', 'same-position')} lens, layers "
               f"{layers[0]}..{layers[-1]} ({len(layers)}), {dtype}: written to {done.path}")


@lens.command("apply")
@click.argument("lens_path", type=click.Path())
@prompt_options()
@model_ref_option(default=None, help="The model the lens was fitted on (a folder, hub id, GGUF file or default) "
                                    "[default: the one the lens records, else default].")
@model_option("device")
@model_option("max_memory")
@model_option("revision")
@model_option("trust_remote_code")
@model_option("gguf_file")
@collect_model_options
@click.option("--ordinary", "ordinary", type=click.Path(), default=None,
              help="Also an ordinary-Jacobian lens (a store fitted from `detjac run --ordinary`, or a saved lens).")
@click.option("--exact/--no-exact", default=True, show_default=True,
              help="Also the prompt's own exact map (its to_output Jacobians: d pullbacks).")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Layer x position heatmaps of the rank of the model's prediction (PNG).")
def apply_cmd(lens_path: str, prompt: str, model: ModelRef | None, model_options: LoadSpec, ordinary: str | None,
              exact: bool, plot: str | None, gguf_file: str | None = None, revision: str | None = None) -> None:
    """Decode a new prompt's layer states through the fitted lens, beside the logit lens and the exact map.

    LENS_PATH: a saved lens, a store with a fitted lens, a Jacobian-lens artifact or fit checkpoint file (.pt,
    e.g. from `detjac lens export` or TransformerLens), or ORG/NAME:FILE from the local Hugging Face cache.

    The table gives, per layer and method, the rank of the model's own next-token prediction at the
    last position among the decoded logits, the relative error of the output read and its top tokens.

    \b
    Examples:
      detjac lens apply gcide.lens --prompt "Oak, n. A tree of the genus"
      detjac lens apply fit.zarr --ordinary ordinary.zarr --prompt "Whale, n. A" --plot whale.png
    """
    from detjac.runs import apply_lens

    check_results([lens_path, *([ordinary] if ordinary else [])], files=(plot,), what="the lens")
    reading = apply_lens(_lenses(lens_path, ordinary), prompt, model_options, model=model, exact=exact, plot=plot,
                         resolve=lambda name: resolve_model_ref(name, gguf_file, revision), token_text=render.piece)

    def decode(token: int) -> str:
        return render.piece(reading.engine.tokenizer, token)

    rows = reading.rows
    click.echo(f"model prediction: {decode(rows[0]['predicted'])}")
    click.echo(f"{'layer':>5}  {'method':<14} {'rank':>6} {'rel. error':>10}  top tokens")
    for r in rows:
        click.echo(f"{r['layer']:>5}  {r['method']:<14} {r['rank']:>6} {r['error']:>10.3g}  "
                   f"{' '.join(decode(t) for t in r['top'])}")
    if reading.plot is not None:
        click.echo(f"wrote {reading.plot}")




@lens.command("evaluate")
@click.argument("lens_path", type=click.Path())
@click.option("--ordinary", "ordinary", type=click.Path(), default=None,
              help="The ordinary-Jacobian lens fitted on the same prompts (a store or a saved lens).")
@model_ref_option(default="default", help="The model the lens was fitted on (a folder, hub id, GGUF file or default).")
@gguf_file_option
@click.option("--prompts", "prompts_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Held-out prompts, one per line [default for the default model: "
                   "benchmarks/data/heldout_prompts.txt, prefixes of held-out dictionary entries].")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Evaluate the first N prompts only.")
@click.option("--exact", "exact", type=click.IntRange(min=0), default=None,
              help="Compute the exact per-prompt map (d pullbacks each) for the first N prompts only [default: all].")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder for lens_rows.csv, lens_summary.csv, lens_summary.md and lens_agreement.png.")
@model_option("device")
def evaluate_cmd(lens_path: str, ordinary: str | None, model: str, gguf_file: str | None, prompts_path: str | None,
                 limit: int | None, exact: int | None, out: str | None, device: str) -> None:
    """Per layer, top-1 / top-10 agreement with the model's own prediction and the relative error of the output
    read, over held-out prompts, for the detached lens, the ordinary lens, the logit lens and the exact map.

    The exact per-prompt map reads y exactly (100 % agreement, error ~1e-15): a check. `self` is the prompt's
    own same-position block T_p h_{L,p}, what the lens averages. Intervals: Wilson 95 % for the rates, normal
    95 % for the mean error.

    \b
    Examples:
      detjac lens evaluate fit.zarr --ordinary ordinary.zarr --out eval/
      detjac lens evaluate gcide.lens --limit 50 --exact 10
    """
    from detjac.runs import evaluate_lens, heldout_prompts

    prompts_path = prompts_path or heldout_prompts(model)
    check_results([lens_path, *([ordinary] if ordinary else [])], folders=(out,), what="the lens")
    done = evaluate_lens(_lenses(lens_path, ordinary), resolve_model_ref(model, gguf_file), prompts_path,
                         device=device, limit=limit, exact=exact, out=out)
    click.echo(done.table)
    if done.written:
        *tables, figure = done.written
        click.echo(f"wrote {out}/lens_rows.csv, lens_summary.csv, lens_summary.md and {figure}")
