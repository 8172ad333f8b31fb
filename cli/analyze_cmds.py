"""``detjac analyze svd|decode|dims|layers|compare|report`` (and the views of ``views_cmds.py``): analyses of a store.

Each command opens the store, calls one function of :mod:`detjac.analysis` inside the dask
scheduler of :mod:`detjac.runs.scheduler`, and prints what it returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from detjac.targets import COMPONENTS, OUTPUT

from . import render
from .options import TABLE_HELP, check_results, cluster_options, parse_target, parse_token, prompt_id_option

if TYPE_CHECKING:
    from detjac.runs import ClusterOptions


@click.group()
def analyze() -> None:
    """Analyses of a store with dask (no model, no GPU): svd, decode, dims, layers, compare, report, graphs, and the
    views columns, image, path.

    \b
    Examples:
      detjac analyze svd run.zarr --k 5 --top 8
      detjac analyze svd run.zarr --token -1 --method exact
      detjac analyze decode run.zarr --target layer.2 --plot decoded.png
      detjac analyze dims run.zarr --table dims.parquet --workers 2
      detjac analyze layers run.zarr --out layers/
      detjac analyze report run.zarr --out report/
      detjac analyze graphs graphs.zarr --table neurons.csv
      detjac analyze columns run.zarr --token -1
      detjac analyze image run.zarr --token 0 --out j0.png
      detjac analyze path lw.zarr --kind layer_normed
    """


K_HELP = "Singular triplets [default: 5, or the K of a low-rank store (--keep rank:K) holding fewer]."
DEFAULT_K = 5


def default_k(store: object) -> int:
    """The default number of triplets: :data:`DEFAULT_K`, or fewer where a low-rank store keeps fewer (a default is
    never an error)."""
    from detjac.store import Keep

    rank = Keep.of_run(getattr(store, "run", {})).rank
    return DEFAULT_K if rank is None else min(DEFAULT_K, rank)


@analyze.command("svd")
@click.argument("path", type=click.Path())
@prompt_id_option(multiple=True, help="A stored prompt's id (repeatable; default: all).")
@click.option("--token", default="combined", show_default=True, help="'combined' or a token index (-1: last).")
@click.option("--k", type=click.IntRange(min=1), default=None, help=K_HELP)
@click.option("--top", type=click.IntRange(min=1), default=8, show_default=True, help="Decoded tokens per vector.")
@click.option("--method", type=click.Choice(["randomized", "gram", "exact"]), default="randomized", show_default=True,
              help="randomized: dask svd_compressed; gram: eigh of the streamed A A^T (one pass); exact: full SVD. "
                   "An operator of 4M entries or fewer (d x d per token, a short prompt's combined one) is always "
                   "decomposed exactly: quicker there, and exact.")
@click.option("--power-iterations", type=click.IntRange(min=0), default=6, show_default=True)
@click.option("--target", default=OUTPUT, show_default=True,
              help="'output' (the model's), or a stored layerwise target such as layer.2, attn.0, mlp_local.3.")
@cluster_options(memory_limit="2GiB", work="the computation")
def svd_cmd(path: str, prompt_ids: tuple[str, ...], token: str, k: int | None, top: int, method: str,
            power_iterations: int, target: str, cluster: ClusterOptions) -> None:
    """Top singular values and decoded tokens per prompt; results are kept in the store.

    Left singular vectors are decoded through the unembedding (for a layerwise target, after
    the final norm's gain) and right ones through the input embedding, all kept in the store
    by `detjac run`. A low-rank store (`run --keep rank:K`) gives its stored triplets (--k at
    most K).

    \b
    Examples:
      detjac analyze svd run.zarr --k 3 --top 6 --workers 2
      detjac analyze svd run.zarr --target mlp.3 --token -1
    """
    from detjac.analysis import decode_report
    from detjac.progress import tqdm
    from detjac.runs import dask_cluster
    from detjac.store import open_store

    index = parse_token(token)
    store = open_store(path)
    ids = list(prompt_ids) or store.prompt_ids()
    k = default_k(store) if k is None else k
    with dask_cluster(cluster, log=click.echo), \
            tqdm(total=len(ids), desc="svd", unit="prompt") as bar:
        result = decode_report(store, ids, k=k, top=top, token=index, target=parse_target(target), method=method,
                               power_iterations=power_iterations, progress=bar)
    render.echo_decoded(result.spectra)


@analyze.command("decode")
@click.argument("path", type=click.Path())
@prompt_id_option(multiple=True, help="A stored prompt's id (repeatable; default: all).")
@click.option("--target", default=OUTPUT, show_default=True,
              help="'output' (the model's), or a stored layerwise target such as layer.2, attn.0, mlp_local.3.")
@click.option("--token", default="combined", show_default=True, help="'combined' or a token index (-1: last).")
@click.option("--k", type=click.IntRange(min=1), default=None, help=K_HELP)
@click.option("--top", type=click.IntRange(min=1), default=8, show_default=True, help="Decoded tokens per vector.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Save the decoded tokens as a figure (PNG, SVG or PDF by suffix).")
@click.option("--table", "table_path", type=click.Path(dir_okay=False), default=None,
              help=f"{TABLE_HELP} One row per triplet; left_tokens and right_tokens are lists of token texts "
                   "(Parquet list columns; in CSV, JSON arrays such as [\" Paris\", \" the\"]), right_position is "
                   "the token the right vector is decoded at, left_ids and right_ids the token ids.")
@cluster_options(memory_limit="2GiB", work="the computation")
def decode_cmd(path: str, prompt_ids: tuple[str, ...], target: str, token: str, k: int | None, top: int,
               plot: str | None, table_path: str | None, cluster: ClusterOptions) -> None:
    """Singular vectors decoded to tokens, as text, a figure and a table.

    Uses the triplets `detjac analyze svd` kept in the store for the same parameters (and
    computes and keeps them otherwise, with the randomized method). Left vectors go through
    the unembedding (for a layerwise target, after the final norm's gain), right vectors
    through the input embedding, at the token whose block holds most of their energy. A
    low-rank store (`run --keep rank:K`) gives its stored triplets (--k at most K).

    \b
    Examples:
      detjac analyze decode run.zarr --k 3 --plot decoded.png
      detjac analyze decode run.zarr --target layer.1 --token -1 --table decoded.parquet
    """
    from detjac.analysis import decode_report
    from detjac.runs import dask_cluster
    from detjac.store import open_store

    index = parse_token(token)
    check_results([path], files=(plot, table_path))
    store = open_store(path)
    ids = list(prompt_ids) or store.prompt_ids()
    k = default_k(store) if k is None else k
    with dask_cluster(cluster, log=click.echo):
        result = decode_report(store, ids, k=k, top=top, token=index, target=parse_target(target), plot=plot,
                               table=table_path)
    render.echo_decoded(result.spectra)
    for written in result.written:
        click.echo(f"wrote {written}")


@analyze.command("dims")
@click.argument("path", type=click.Path())
@prompt_id_option(multiple=True, help="A stored prompt's id (repeatable; default: all).")
@click.option("--table", "--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help=TABLE_HELP)
@cluster_options(memory_limit="2GiB", work="the computation")
def dims_cmd(path: str, prompt_ids: tuple[str, ...], csv_path: str | None, cluster: ClusterOptions) -> None:
    """Stable rank, participation ratio and n90/n99 of every prompt's combined and per-token operators.

    (Per layer and component: `detjac analyze layers`.) Needs every singular value: a
    low-rank store (`run --keep rank:K`, top triplets only) is refused; run without --keep.

    \b
    Example:
      detjac analyze dims run.zarr --table dims.csv
    """
    from detjac.analysis import dims_report, require_full
    from detjac.progress import tqdm
    from detjac.runs import dask_cluster
    from detjac.store import open_store

    check_results([path], files=(csv_path,))
    store = open_store(path)
    require_full(store, "analyze dims")  # before the bar
    ids = list(prompt_ids) or store.prompt_ids()
    with dask_cluster(cluster, log=click.echo), \
            tqdm(total=len(ids), desc="dims", unit="prompt") as bar:
        result = dims_report(store, ids, table=csv_path, progress=bar)
    render.echo_dims(result.rows)
    if result.table is not None:
        click.echo(f"wrote {result.table}")


def parse_positions(value: str) -> tuple[int, ...]:
    """``"0, 1,-1"`` -> ``(0, 1, -1)``; an empty text: no position."""
    parts = [v.strip() for v in value.split(",") if v.strip()]
    try:
        return tuple(int(v) for v in parts)
    except ValueError:
        raise click.BadParameter(f"Expected comma-separated token positions such as 0 or 0,1. Got {value!r}.",
                                 param_hint="--skip-positions") from None


@analyze.command("graphs")
@click.argument("path", type=click.Path())
@prompt_id_option(multiple=True, help="A stored prompt's id (repeatable; default: all).")
@click.option("--min-graphs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Only neurons in at least this many graphs.")
@click.option("--top", type=click.IntRange(min=1), default=30, show_default=True,
              help="Neurons printed (the --table holds them all).")
@click.option("--table", "table_path", type=click.Path(dir_okay=False), default=None, help=TABLE_HELP)
@click.option("--skip-positions", default="", callback=lambda ctx, param, value: parse_positions(value),
              help="Comma-separated positions whose neurons are left out of every graph (0: the first token, "
                   "whose attention-sink neurons otherwise top the list; -1: the last).")
def graphs_cmd(path: str, prompt_ids: tuple[str, ...], min_graphs: int, top: int, table_path: str | None,
               skip_positions: tuple[int, ...]) -> None:
    """The MLP neurons that recur across the prompts' attribution graphs (a `detjac run --graph` store).

    One row per neuron (layer, index), at whatever positions its graphs keep it, sorted by the
    number of graphs it appears in: its label (top tokens of its write vector through the
    unembedding, then of its read vector through the embedding), graphs, share of the graphs
    read, nodes (positions kept, over all graphs), mean attribution and mean activation. A
    neuron's attribution in one graph is the sum of the weights of its outgoing links in that
    pruned graph, over its positions (its direct effect on the graph's neurons and logits,
    signed); mean attribution averages it over the graphs the neuron appears in.

    \b
    Examples:
      detjac analyze graphs graphs.zarr
      detjac analyze graphs graphs.zarr --skip-positions 0
      detjac analyze graphs graphs.zarr --min-graphs 3 --table neurons.parquet
    """
    from detjac.analysis import recurring_neurons
    from detjac.progress import tqdm
    from detjac.store import open_store

    check_results([path], files=(table_path,))
    store = open_store(path)
    ids = list(prompt_ids) or store.prompt_ids()
    with tqdm(total=len(ids), desc="graphs", unit="prompt") as bar:
        result = recurring_neurons(store, ids, min_graphs=min_graphs, skip_positions=skip_positions, table=table_path,
                                   progress=bar)
    render.echo_graph_neurons(result, top)
    if result.table is not None:
        click.echo(f"wrote {result.table}")


@analyze.command("layers")
@click.argument("path", type=click.Path())
@prompt_id_option(multiple=True, help="A stored prompt's id (repeatable; default: all).")
@click.option("--out", "-o", "out_dir", type=click.Path(file_okay=False), default="detjac-layers", show_default=True,
              help="Folder for the tables and figures.")
@click.option("--k", type=click.IntRange(min=1), default=4, show_default=True,
              help="Left singular vectors searched for the token (first_sv).")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="A token 'appears' when it is among this many decoded tokens.")
@click.option("--token", "token_text", default=None,
              help="Token to track (one token of the store's tokenizer, or id:N); default: each prompt's prediction.")
@click.option("--component", type=click.Choice(COMPONENTS), default="layer", show_default=True,
              help="Targets of the layer x token heatmaps.")
@click.option("--heatmaps", type=click.IntRange(min=0), default=4, show_default=True,
              help="Heatmaps for this many prompts (the first ones).")
@click.option("--format", "table_format", type=click.Choice(["csv", "parquet"]), default="csv", show_default=True)
@cluster_options(memory_limit="2GiB", work="the computation")
def layers_cmd(path: str, prompt_ids: tuple[str, ...], out_dir: str, k: int, top: int, token_text: str | None,
               component: str, heatmaps: int, table_format: str, cluster: ClusterOptions) -> None:
    """Layerwise decomposition: spectra, decoded tokens and where the prediction emerges.

    Needs a store written with `detjac run ... --layers`. For every stored target (layer.L,
    attn.L, mlp.L, resid_mid.L, *_normed.L, *_local.L, to_output.L) of every prompt, saying
    which were normed: dimensionality of [J_1 ... J_n], the rank of
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
    from detjac.analysis import layerwise_report
    from detjac.progress import tqdm
    from detjac.runs import dask_cluster
    from detjac.store import open_store

    check_results([path], folders=(out_dir,))
    store = open_store(path)
    ids = list(prompt_ids) or store.prompt_ids()
    with dask_cluster(cluster, log=click.echo), \
            tqdm(total=len(ids), desc="layers", unit="prompt") as bar:
        report = layerwise_report(store, ids, out_dir, k=k, top=top, token=token_text, component=component,
                              heatmaps=heatmaps, table_format=table_format, progress=bar)
    render.echo_layer_report(report)


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
    from detjac.analysis import compare_report
    from detjac.store import open_store

    check_results([detached_path, ordinary_path], files=(plot, csv_path))
    render.echo_compare(compare_report(open_store(detached_path), open_store(ordinary_path), top, plot, csv_path))


@analyze.command("report")
@click.argument("path", type=click.Path())
@click.option("--out", "-o", "out_dir", type=click.Path(file_okay=False), default="detjac-report", show_default=True,
              help="Folder for the CSV tables, summary.json and PNG figures.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Decoded tokens of u_1 searched for the prediction.")
@click.option("--format", "table_format", type=click.Choice(["csv", "parquet"]), default="csv", show_default=True)
@cluster_options(memory_limit="2GiB", work="the computation")
def report_cmd(path: str, out_dir: str, top: int, table_format: str, cluster: ClusterOptions) -> None:
    """Corpus report: dimensionality and decoded u_1 of every prompt, as tables and figures.

    Writes dims.csv, decoded.csv (or .parquet), summary.json, spectra.png,
    dims_by_position.png and decoded.png; with layerwise Jacobians in the store also
    layers.csv, emergence.csv, layer_dims.png and emergence.png. The per-prompt results are
    kept in the store and reused next time. Needs every singular value: a low-rank store
    (`run --keep rank:K`) is refused; run without --keep.

    \b
    Example:
      detjac analyze report run.zarr --out report/ --workers 2
    """
    from detjac.analysis import analysis_report, require_full
    from detjac.progress import tqdm
    from detjac.runs import dask_cluster
    from detjac.store import open_store

    check_results([path], folders=(out_dir,))
    store = open_store(path)
    require_full(store, "analyze report")  # before the bar
    with dask_cluster(cluster, log=click.echo), \
            tqdm(total=len(store), desc="report", unit="prompt") as bar:
        summary = analysis_report(store, out_dir, top, progress=bar, table_format=table_format)
    click.echo(f"{summary['prompts']} prompts: prediction among the top-{top} tokens of u_1 in "
               f"{summary['prediction_in_u1_top']:.0%}; median stable rank of [J_1 ... J_n] "
               f"{summary['median_stable_rank_combined']:.2f}, median n90 {summary['median_n90_combined']:.0f}")
    click.echo(f"wrote {', '.join(summary['files'])} to {out_dir}")
