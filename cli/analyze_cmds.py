"""``detjac analyze svd|decode|dims|layers|compare|report``: dask analyses of a store, results written back."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import click


def _token(value: str) -> int | None:
    if value == "combined":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise click.BadParameter(f"Expected 'combined' or a token index. Got {value!r}.") from exc


@contextlib.contextmanager
def dask_scheduler(workers: int, scheduler: str | None, memory_limit: str) -> Iterator[Any]:
    """A dask.distributed client: on ``scheduler`` if given, else a LocalCluster of ``workers`` (0: none).

    Without a client, dask's own progress bar reports every array computation that takes over
    two seconds; with one, the dashboard (its link is printed) shows the task stream.
    """
    if scheduler is None and workers == 0:
        from dask.diagnostics import ProgressBar

        with ProgressBar(minimum=2.0, dt=0.5, out=sys.stderr):
            yield None
        return
    from .cluster import dask_client

    with dask_client(workers, scheduler, memory_limit) as client:
        yield client


_SCHEDULER_OPTIONS = [
    click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
                 help="LocalCluster worker processes (0: dask's threaded scheduler in this process)."),
    click.option("--memory-limit", default="2GiB", show_default=True, help="Memory limit per LocalCluster worker."),
    click.option("--scheduler", default=None, help="Address of an existing dask.distributed scheduler."),
]

TABLE_HELP = "Write the table to this file: Parquet for a .parquet suffix, else CSV."


def _target(prompt_target: str | None) -> str | None:
    return None if prompt_target in (None, "output") else prompt_target


def scheduler_options(func: Any) -> Any:
    for option in reversed(_SCHEDULER_OPTIONS):
        func = option(func)
    return func


@click.group()
def analyze() -> None:
    """Analyses of a store with dask (no model, no GPU): svd, decode, dims, layers, compare, report.

    \b
    Examples:
      detjac analyze svd run.zarr --k 5 --top 8
      detjac analyze svd run.zarr --token -1 --method exact
      detjac analyze decode run.zarr --target layer.2 --plot decoded.png
      detjac analyze dims run.zarr --table dims.parquet --workers 2
      detjac analyze layers run.zarr --out layers/
      detjac analyze report run.zarr --out report/
    """


@analyze.command("svd")
@click.argument("path", type=click.Path())
@click.option("--prompt", "prompt_ids", multiple=True, help="Prompt id (repeatable; default: all).")
@click.option("--token", default="combined", show_default=True, help="'combined' or a token index (-1: last).")
@click.option("--k", type=click.IntRange(min=1), default=5, show_default=True, help="Singular triplets.")
@click.option("--top", type=click.IntRange(min=1), default=8, show_default=True, help="Decoded tokens per vector.")
@click.option("--method", type=click.Choice(["randomized", "gram", "exact"]), default="randomized", show_default=True,
              help="randomized: dask svd_compressed; gram: eigh of the streamed A A^T (one pass); exact: full SVD.")
@click.option("--power-iterations", type=click.IntRange(min=0), default=6, show_default=True)
@click.option("--target", default="output", show_default=True,
              help="'output' (the model's), or a stored layerwise target such as layer.2, attn.0, mlp_local.3.")
@scheduler_options
def svd_cmd(path: str, prompt_ids: tuple[str, ...], token: str, k: int, top: int, method: str,
            power_iterations: int, target: str, workers: int, memory_limit: str, scheduler: str | None) -> None:
    """Top singular values and decoded tokens per prompt; results are kept in the store.

    Left singular vectors are decoded through the unembedding (for a layerwise target, after
    the final norm's gain) and right ones through the input embedding, all kept in the store
    by `detjac run`.

    \b
    Examples:
      detjac analyze svd run.zarr --k 3 --top 6 --workers 2
      detjac analyze svd run.zarr --target mlp.3 --token -1
    """
    from tqdm.auto import tqdm

    from detjac.analysis import jobs
    from detjac.store import open_store

    store = open_store(path)
    ids = list(prompt_ids) or store.prompt_ids()
    with dask_scheduler(workers, scheduler, memory_limit), tqdm(total=len(ids), desc="svd", unit="prompt") as bar:
        spectra = jobs.svd(store, ids, k, _token(token), method=method, power_iterations=power_iterations,
                           target=_target(target), progress=bar)
    _echo_decoded(store, spectra, top)


def _echo_decoded(store: Any, spectra: list[Any], top: int) -> list[tuple[str, list[list[str]]]]:
    """Print each spectrum's singular values with their decoded tokens; returns them as figure sections."""
    from detjac.analysis import jobs

    text = jobs.token_texts(store)
    sections = []
    for spec in spectra:
        prompt = store.get(spec.prompt_id)
        what = spec.target or "output"
        where = "[J_1 ... J_n]" if spec.token is None else f"J_{spec.token}"
        title = f"{spec.prompt_id} {prompt.prompt[:70]!r} -> next {prompt.attrs.get('next_token')!r}"
        click.echo(f"\n{title}\n  {what}, {where}")
        decoded = jobs.decode_spectrum(store, spec, top)
        cells = []
        for i, sigma in enumerate(spec.S):
            left = " ".join(text(t) for t in decoded["left_ids"][i])
            right = " ".join(text(t) for t in decoded["right_ids"][i])
            at = decoded["right_tokens"][i]
            click.echo(f"  #{i + 1} sigma {sigma:<9.4g} left -> {left}")
            click.echo(f"     right [token {at}, {decoded['right_shares'][i]:.0%}] -> {right}")
            cells.append([f"{i + 1}", f"{sigma:.4g}", left, f"[{at}] {right}"])
        sections.append((f"{title}: {what}, {where}", cells))
    return sections


@analyze.command("decode")
@click.argument("path", type=click.Path())
@click.option("--prompt", "prompt_ids", multiple=True, help="Prompt id (repeatable; default: all).")
@click.option("--target", default="output", show_default=True,
              help="'output' (the model's), or a stored layerwise target such as layer.2, attn.0, mlp_local.3.")
@click.option("--token", default="combined", show_default=True, help="'combined' or a token index (-1: last).")
@click.option("--k", type=click.IntRange(min=1), default=5, show_default=True, help="Singular triplets.")
@click.option("--top", type=click.IntRange(min=1), default=8, show_default=True, help="Decoded tokens per vector.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Save the decoded tokens as a figure (PNG, SVG or PDF by suffix).")
@click.option("--table", "table_path", type=click.Path(dir_okay=False), default=None, help=TABLE_HELP)
@scheduler_options
def decode_cmd(path: str, prompt_ids: tuple[str, ...], target: str, token: str, k: int, top: int, plot: str | None,
               table_path: str | None, workers: int, memory_limit: str, scheduler: str | None) -> None:
    """Singular vectors decoded to tokens, as text, a figure and a table.

    Uses the triplets `detjac analyze svd` kept in the store for the same parameters (and
    computes and keeps them otherwise, with the randomized method). Left vectors go through
    the unembedding (for a layerwise target, after the final norm's gain), right vectors
    through the input embedding, at the token whose block holds most of their energy.

    \b
    Examples:
      detjac analyze decode run.zarr --k 3 --plot decoded.png
      detjac analyze decode run.zarr --target layer.1 --token -1 --table decoded.parquet
    """
    from detjac.analysis import jobs
    from detjac.analysis.plots import plot_decoded
    from detjac.store import open_store

    store = open_store(path)
    ids = list(prompt_ids) or store.prompt_ids()
    with dask_scheduler(workers, scheduler, memory_limit):
        spectra = jobs.svd(store, ids, k, _token(token), target=_target(target))
    sections = _echo_decoded(store, spectra, top)
    if plot:
        click.echo(f"wrote {plot_decoded(sections, plot)}")
    if table_path:
        rows = [{"prompt_id": spec.prompt_id, "target": target, "token": token, "index": i + 1, "sigma": float(s),
                 "left_tokens": cells[i][2], "right_tokens": cells[i][3]}
                for spec, (_, cells) in zip(spectra, sections, strict=True) for i, s in enumerate(spec.S)]
        click.echo(f"wrote {jobs.write_table(rows, table_path)}")


@analyze.command("dims")
@click.argument("path", type=click.Path())
@click.option("--prompt", "prompt_ids", multiple=True, help="Prompt id (repeatable; default: all).")
@click.option("--table", "--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help=TABLE_HELP)
@scheduler_options
def dims_cmd(path: str, prompt_ids: tuple[str, ...], csv_path: str | None, workers: int, memory_limit: str,
             scheduler: str | None) -> None:
    """Stable rank, participation ratio and n90/n99 of every prompt's combined and per-token operators.

    (Per layer and component: `detjac analyze layers`.)

    \b
    Example:
      detjac analyze dims run.zarr --table dims.csv
    """
    from tqdm.auto import tqdm

    from detjac.analysis import jobs
    from detjac.store import open_store

    store = open_store(path)
    ids = list(prompt_ids) or store.prompt_ids()
    with dask_scheduler(workers, scheduler, memory_limit), tqdm(total=len(ids), desc="dims", unit="prompt") as bar:
        rows = jobs.dims(store, ids, progress=bar)
    click.echo(f"{'prompt':<17} {'token':>8} {'stable rank':>11} {'part. ratio':>11} {'n90':>4} {'n99':>4}")
    for r in rows:
        click.echo(f"{r['prompt_id']:<17} {r['token']!s:>8} {r['stable_rank']:>11.2f} "
                   f"{r['participation_ratio']:>11.2f} {r['n90']:>4} {r['n99']:>4}")
    if csv_path:
        click.echo(f"wrote {jobs.write_table(rows, csv_path)}")


@analyze.command("layers")
@click.argument("path", type=click.Path())
@click.option("--prompt", "prompt_ids", multiple=True, help="Prompt id (repeatable; default: all).")
@click.option("--out", "-o", "out_dir", type=click.Path(file_okay=False), default="detjac-layers", show_default=True,
              help="Folder for the tables and figures.")
@click.option("--k", type=click.IntRange(min=1), default=4, show_default=True,
              help="Left singular vectors searched for the token (first_sv).")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="A token 'appears' when it is among this many decoded tokens.")
@click.option("--token", "token_text", default=None,
              help="Token to track (one token of the store's tokenizer, or id:N); default: each prompt's prediction.")
@click.option("--component", type=click.Choice(["layer", "attn", "mlp"]), default="layer", show_default=True,
              help="Targets of the layer x token heatmaps.")
@click.option("--heatmaps", type=click.IntRange(min=0), default=4, show_default=True,
              help="Heatmaps for this many prompts (the first ones).")
@click.option("--format", "table_format", type=click.Choice(["csv", "parquet"]), default="csv", show_default=True)
@scheduler_options
def layers_cmd(path: str, prompt_ids: tuple[str, ...], out_dir: str, k: int, top: int, token_text: str | None,
               component: str, heatmaps: int, table_format: str, workers: int, memory_limit: str,
               scheduler: str | None) -> None:
    """Layerwise decomposition: spectra, decoded tokens and where the prediction emerges.

    Needs a store written with `detjac run ... --layers`. For every stored target (layer.L,
    attn.L, mlp.L, *_local.L) of every prompt: dimensionality of [J_1 ... J_n], the rank of
    the tracked token in the decoded leading left singular vector (u_1) and in the decoded
    output itself (the logit lens). Writes layers.csv, emergence.csv, layer_dims.png,
    emergence.png and heatmap_<prompt>.png (the token's rank per layer and input token);
    results are kept in the store and reused next time.

    \b
    Examples:
      detjac run default prompts.txt --out lw.zarr --layers all --components layer,attn,mlp
      detjac analyze layers lw.zarr --out layers/
      detjac analyze layers lw.zarr --token " tree" --component mlp --format parquet
    """
    from pathlib import Path

    from tqdm.auto import tqdm

    from detjac.analysis import jobs, layers
    from detjac.analysis.plots import plot_emergence, plot_layer_dims, plot_token_heatmap
    from detjac.store import open_store

    store = open_store(path)
    ids = list(prompt_ids) or store.prompt_ids()
    tracked = None if token_text is None else jobs.token_id(store, token_text)
    text = jobs.token_texts(store)
    out = Path(out_dir)
    with dask_scheduler(workers, scheduler, memory_limit), \
            tqdm(total=len(ids), desc="layers", unit="prompt") as bar:
        rows = layers.layer_table(store, ids, k=k, top=top, token=tracked, progress=bar)
        heats = [layers.token_heatmap(store, pid, component, token=tracked) for pid in ids[:heatmaps]]
    click.echo(f"{'prompt':<17} {'target':<14} {'sigma_1':>9} {'srank':>7} {'n90':>4} {'u1 rank':>7} "
               f"{'lens rank':>9}  u_1 decoded")
    for r in rows:
        click.echo(f"{r['prompt_id']:<17} {r['target']:<14} {r['sigma_1']:>9.4g} {r['stable_rank']:>7.2f} "
                   f"{r['n90']:>4} {r['u1_rank']:>7} {r['lens_rank']:>9}  "
                   f"{' '.join(text(t) for t in r['u1_tokens'][:6])}")
    emerged = layers.emergence(rows)
    for e in emerged:
        click.echo(f"{e['prompt_id']} {e['component']:<5} tracking {text(e['token'])}: in the top {top} of u_1 "
                   f"from layer {e['first_layer_u1'] if e['first_layer_u1'] >= 0 else 'never'}, of the logit lens "
                   f"from layer {e['first_layer_lens'] if e['first_layer_lens'] >= 0 else 'never'}")
    written = [jobs.write_table(rows, out / f"layers.{table_format}"),
               jobs.write_table(emerged, out / f"emergence.{table_format}"),
               plot_layer_dims(rows, out / "layer_dims.png"), plot_emergence(rows, out / "emergence.png", top)]
    for pid, heat in zip(ids, heats, strict=False):
        written.append(plot_token_heatmap(heat, out / f"heatmap_{pid}.png", text(heat["token"]),
                                          store.get(pid).prompt[:100]))
    click.echo(f"wrote {', '.join(p.name for p in written)} to {out}")


@analyze.command("compare")
@click.argument("detached_path", type=click.Path())
@click.argument("ordinary_path", type=click.Path())
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Decoded tokens of u_1 searched for the prediction.")
@click.option("--plot", type=click.Path(dir_okay=False), default="detjac-compare.png", show_default=True)
@click.option("--table", "--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help=TABLE_HELP)
def compare_cmd(detached_path: str, ordinary_path: str, top: int, plot: str, csv_path: str | None) -> None:
    """Detached against ordinary Jacobians of the same prompts: table and plot.

    DETACHED_PATH comes from `detjac run`, ORDINARY_PATH from `detjac run --ordinary` on
    the same prompts (matched by text).

    \b
    Example:
      detjac run default p.txt --out det.zarr && detjac run default p.txt --out ord.zarr --ordinary
      detjac analyze compare det.zarr ord.zarr --plot compare.png
    """
    from detjac.analysis import jobs
    from detjac.analysis.compare import compare, plot_compare
    from detjac.store import open_store

    rows = compare(open_store(detached_path), open_store(ordinary_path), top)
    click.echo(f"{'prompt':<17} {'error det':>9} {'error ord':>9} {'sigma1 det':>10} {'sigma1 ord':>10} "
               f"{'srank det':>9} {'srank ord':>9} {'u1 det':>6} {'u1 ord':>6}")
    for r in rows:
        click.echo(f"{r['prompt_id']:<17} {r['detached_error']:>9.1e} {r['ordinary_error']:>9.1e} "
                   f"{r['detached_sigma_1']:>10.4g} {r['ordinary_sigma_1']:>10.4g} {r['detached_stable_rank']:>9.2f} "
                   f"{r['ordinary_stable_rank']:>9.2f} {'hit' if r['detached_u1_hit'] else '-':>6} "
                   f"{'hit' if r['ordinary_u1_hit'] else '-':>6}")
    hits = [sum(r[f"{key}_u1_hit"] for r in rows) for key in ("detached", "ordinary")]
    click.echo(f"prediction among the top-{top} decoded tokens of u_1: detached {hits[0]}/{len(rows)}, "
               f"ordinary {hits[1]}/{len(rows)}")
    click.echo(f"wrote {plot_compare(rows, plot)}")
    if csv_path:
        table = jobs.write_table([{k: v for k, v in r.items() if not k.endswith("spectrum")} for r in rows], csv_path)
        click.echo(f"wrote {table}")


@analyze.command("report")
@click.argument("path", type=click.Path())
@click.option("--out", "-o", "out_dir", type=click.Path(file_okay=False), default="detjac-report", show_default=True,
              help="Folder for the CSV tables, summary.json and PNG figures.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Decoded tokens of u_1 searched for the prediction.")
@click.option("--format", "table_format", type=click.Choice(["csv", "parquet"]), default="csv", show_default=True)
@scheduler_options
def report_cmd(path: str, out_dir: str, top: int, table_format: str, workers: int, memory_limit: str,
               scheduler: str | None) -> None:
    """Corpus report: dimensionality and decoded u_1 of every prompt, as tables and figures.

    Writes dims.csv, decoded.csv (or .parquet), summary.json, spectra.png,
    dims_by_position.png and decoded.png; with layerwise Jacobians in the store also
    layers.csv, emergence.csv, layer_dims.png and emergence.png. The per-prompt results are
    kept in the store and reused next time.

    \b
    Example:
      detjac analyze report run.zarr --out report/ --workers 2
    """
    from tqdm.auto import tqdm

    from detjac.analysis.report import report
    from detjac.store import open_store

    store = open_store(path)
    with dask_scheduler(workers, scheduler, memory_limit), \
            tqdm(total=len(store), desc="report", unit="prompt") as bar:
        summary = report(store, out_dir, top, progress=bar, table_format=table_format)
    click.echo(f"{summary['prompts']} prompts: prediction among the top-{top} tokens of u_1 in "
               f"{summary['prediction_in_u1_top']:.0%}; median stable rank of [J_1 ... J_n] "
               f"{summary['median_stable_rank_combined']:.2f}, median n90 {summary['median_n90_combined']:.0f}")
    click.echo(f"wrote {', '.join(summary['files'])} to {out_dir}")
