"""``detjac analyze svd|dims``: dask analyses of a store, results written back into it."""

from __future__ import annotations

import contextlib
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
    """A dask.distributed client: on ``scheduler`` if given, else a LocalCluster of ``workers`` (0: none)."""
    if scheduler is None and workers == 0:
        yield None
        return
    from distributed import Client, LocalCluster

    if scheduler is not None:
        with Client(scheduler) as client:
            click.echo(f"dask scheduler {scheduler}, dashboard {client.dashboard_link}")
            yield client
        return
    with LocalCluster(n_workers=workers, threads_per_worker=1, memory_limit=memory_limit,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        click.echo(f"dask LocalCluster: {workers} workers x {memory_limit}, dashboard {client.dashboard_link}")
        yield client


_SCHEDULER_OPTIONS = [
    click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
                 help="LocalCluster worker processes (0: dask's threaded scheduler in this process)."),
    click.option("--memory-limit", default="2GiB", show_default=True, help="Memory limit per LocalCluster worker."),
    click.option("--scheduler", default=None, help="Address of an existing dask.distributed scheduler."),
]


def scheduler_options(func: Any) -> Any:
    for option in reversed(_SCHEDULER_OPTIONS):
        func = option(func)
    return func


@click.group()
def analyze() -> None:
    """Analyses of a store with dask (no model, no GPU): svd, dims, compare, report.

    \b
    Examples:
      detjac analyze svd run.zarr --k 5 --top 8
      detjac analyze svd run.zarr --token -1 --method exact
      detjac analyze dims run.zarr --csv dims.csv --workers 2
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
@scheduler_options
def svd_cmd(path: str, prompt_ids: tuple[str, ...], token: str, k: int, top: int, method: str,
            power_iterations: int, workers: int, memory_limit: str, scheduler: str | None) -> None:
    """Top singular values and decoded tokens per prompt; results are kept in the store.

    Left singular vectors are decoded through the unembedding and right ones through the
    input embedding, both kept in the store by `detjac run`.

    \b
    Example:
      detjac analyze svd run.zarr --k 3 --top 6 --workers 2
    """
    from tqdm.auto import tqdm

    from detjac.analysis import jobs
    from detjac.store import open_store

    store = open_store(path)
    ids = list(prompt_ids) or store.prompt_ids()
    text = jobs.token_texts(store)
    with dask_scheduler(workers, scheduler, memory_limit), tqdm(total=len(ids), desc="svd", unit="prompt") as bar:
        spectra = jobs.svd(store, ids, k, _token(token), method=method, power_iterations=power_iterations,
                           progress=bar)
    for spec in spectra:
        prompt = store.get(spec.prompt_id)
        click.echo(f"\n{spec.prompt_id} {prompt.prompt[:70]!r} -> next {prompt.attrs.get('next_token')!r}")
        decoded = jobs.decode_spectrum(store, spec, top)
        for i, sigma in enumerate(spec.S):
            left = " ".join(text(t) for t in decoded["left_ids"][i])
            right = " ".join(text(t) for t in decoded["right_ids"][i])
            at = decoded["right_tokens"][i]
            click.echo(f"  #{i + 1} sigma {sigma:<9.4g} left -> {left}")
            click.echo(f"     right [token {at}, {decoded['right_shares'][i]:.0%}] -> {right}")


@analyze.command("dims")
@click.argument("path", type=click.Path())
@click.option("--prompt", "prompt_ids", multiple=True, help="Prompt id (repeatable; default: all).")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help="Write the table as CSV.")
@scheduler_options
def dims_cmd(path: str, prompt_ids: tuple[str, ...], csv_path: str | None, workers: int, memory_limit: str,
             scheduler: str | None) -> None:
    """Stable rank, participation ratio and n90/n99 of every prompt's combined and per-token operators.

    \b
    Example:
      detjac analyze dims run.zarr --csv dims.csv
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
        jobs.to_csv(rows, csv_path)
        click.echo(f"wrote {csv_path}")


@analyze.command("compare")
@click.argument("detached_path", type=click.Path())
@click.argument("ordinary_path", type=click.Path())
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Decoded tokens of u_1 searched for the prediction.")
@click.option("--plot", type=click.Path(dir_okay=False), default="detjac-compare.png", show_default=True)
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help="Write the table as CSV.")
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
        jobs.to_csv([{k: v for k, v in r.items() if not k.endswith("spectrum")} for r in rows], csv_path)
        click.echo(f"wrote {csv_path}")


@analyze.command("report")
@click.argument("path", type=click.Path())
@click.option("--out", "-o", "out_dir", type=click.Path(file_okay=False), default="detjac-report", show_default=True,
              help="Folder for the CSV tables, summary.json and PNG figures.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Decoded tokens of u_1 searched for the prediction.")
@scheduler_options
def report_cmd(path: str, out_dir: str, top: int, workers: int, memory_limit: str, scheduler: str | None) -> None:
    """Corpus report: dimensionality and decoded u_1 of every prompt, as tables and figures.

    Writes dims.csv, decoded.csv, summary.json, spectra.png, dims_by_position.png and
    decoded.png; the per-prompt results are kept in the store and reused next time.

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
        summary = report(store, out_dir, top, progress=bar)
    click.echo(f"{summary['prompts']} prompts: prediction among the top-{top} tokens of u_1 in "
               f"{summary['prediction_in_u1_top']:.0%}; median stable rank of [J_1 ... J_n] "
               f"{summary['median_stable_rank_combined']:.2f}, median n90 {summary['median_n90_combined']:.0f}")
    click.echo(f"wrote {', '.join(summary['files'])} to {out_dir}")
