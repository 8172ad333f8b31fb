"""The corpus question of stored attribution graphs (``detjac run --graph``): which MLP neurons recur across the
prompts' graphs, with their labels, in how many graphs they appear and their mean attribution.

Reads each prompt's graph as the store keeps it (:meth:`detjac.store.StoredPrompt.graph_arrays`: node and link tables,
checked, never made into JSON objects) and counts each graph's neurons with a few numpy reductions. Definitions:
docs/graphs.md, "In the store".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from ..store import StoreReader

NEURON, TOKEN = 0, 1  # node_kind of a neuron, of a token (docs/store-format.md, "The graph group")


@dataclass
class GraphNeurons:
    """What :func:`recurring_neurons` found.

    Attributes
    ----------
    rows : list[dict]
        One per neuron ``(layer, index)`` kept in at least ``min_graphs`` graphs, most graphs first: ``layer``,
        ``index``, ``label`` (its clerp: the top tokens of its write vector through the unembedding and of its read
        vector through the embedding), ``graphs`` (graphs it appears in, at any position), ``share`` (``graphs`` over
        the graphs read), ``nodes`` (its nodes over all graphs: one per position kept), ``mean_attribution`` (see
        :func:`recurring_neurons`), ``mean_activation`` (mean of its nodes' activations) and ``prompt_ids`` (the
        prompts whose graph holds it).
    n_graphs : int
        Graphs read.
    without_graph : list[str]
        Prompts asked for that were stored without a graph (skipped).
    skipped_positions : tuple[int, ...]
        The positions whose neuron nodes were left out (``skip_positions``).
    table : Path or None
        The table written, if any.
    """

    rows: list[dict[str, Any]]
    n_graphs: int
    without_graph: list[str] = field(default_factory=list)
    table: Path | None = None
    skipped_positions: tuple[int, ...] = ()


def recurring_neurons(store: StoreReader, prompt_ids: Iterable[str] | None = None, *, min_graphs: int = 1,
                      skip_positions: Iterable[int] = (), table: str | Path | None = None,
                      progress: Any = None) -> GraphNeurons:
    """The neurons that recur across the stored graphs of ``prompt_ids`` (default: every prompt).

    A neuron is ``(layer, index)``, at whatever positions its graph keeps it. Its **attribution in one graph** is the
    sum of the weights of its outgoing links in that (pruned) graph over all its positions: the direct effect it puts
    on the graph's other neurons and logits (signed). ``mean_attribution`` is that sum averaged over the graphs
    the neuron appears in.

    Parameters
    ----------
    store
        A store written by ``detjac run --graph``.
    prompt_ids
        The prompts whose graphs are counted; prompts stored without a graph are skipped (and listed).
    min_graphs
        Only neurons in at least this many graphs.
    skip_positions
        Positions whose neuron nodes are left out of every graph before counting (0: the first token, whose
        "attention-sink" neurons otherwise top the list in every graph); a negative position counts from each
        prompt's end (-1: its last token). A neuron left with no node in a graph does not appear in it.
    table
        Also write the rows here: Parquet for a ``.parquet`` suffix, else CSV (``prompt_ids`` space-separated).
    progress
        A tqdm-like bar, updated once per prompt.

    Raises
    ------
    InvalidArgumentError
        ``min_graphs`` below 1, a position that is not an integer, or none of the prompts has a graph (a store
        written without ``--graph``).
    """
    if isinstance(min_graphs, bool) or not isinstance(min_graphs, int) or min_graphs < 1:
        raise InvalidArgumentError(f"Expected min_graphs to be a positive integer. Got {min_graphs!r}.")
    skip = tuple(skip_positions)
    if any(isinstance(p, bool) or not isinstance(p, int | np.integer) for p in skip):
        raise InvalidArgumentError(f"Expected skip_positions to be integer positions (0: the first token). "
                                   f"Got {list(skip)!r}.")
    ids = list(store.prompt_ids() if prompt_ids is None else prompt_ids)
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    without: list[str] = []
    n_graphs = 0
    for pid in ids:
        tables = store.get(pid).graph_arrays()
        if progress is not None:
            progress.update()
        if tables is None:
            without.append(pid)
            continue
        n_graphs += 1
        for key, label, attribution, activations in _neurons_of(tables, skip):
            entry = seen.setdefault(key, {"label": label, "prompt_ids": [], "attribution": [], "activations": []})
            entry["prompt_ids"].append(pid)
            entry["attribution"].append(attribution)
            entry["activations"].extend(activations)
    if n_graphs == 0:
        raise InvalidArgumentError(f"Expected prompts stored with their attribution graphs (`detjac run --graph`). "
                                   f"Got {len(ids)} prompt{'s' * (len(ids) != 1)} without one.")
    rows = [{"layer": layer, "index": index, "label": e["label"], "graphs": len(e["prompt_ids"]),
             "share": len(e["prompt_ids"]) / n_graphs, "nodes": len(e["activations"]),
             "mean_attribution": float(np.mean(e["attribution"])), "mean_activation": float(np.mean(e["activations"])),
             "prompt_ids": e["prompt_ids"]}
            for (layer, index), e in seen.items() if len(e["prompt_ids"]) >= min_graphs]
    rows.sort(key=lambda r: (-r["graphs"], -abs(r["mean_attribution"]), r["layer"], r["index"]))
    written = None
    if table is not None and rows:
        from .jobs import write_table

        written = write_table(rows, table)
    return GraphNeurons(rows, n_graphs, without, written, tuple(int(p) for p in skip))


def _neurons_of(tables: dict[str, np.ndarray], skip: tuple[int, ...] = ()
                ) -> Iterator[tuple[tuple[int, int], str, float, list[float]]]:
    """Each neuron ``(layer, index)`` of one graph's tables: its label, the sum of its nodes' outgoing links, the
    activations of its nodes (one per position kept, positions in ``skip`` left out)."""
    n = len(tables["node_kind"])
    out_weight = np.bincount(tables["link_source"], weights=tables["link_weight"], minlength=n)
    positions = tables["node_position"]
    n_tokens = int(positions.max(initial=0, where=tables["node_kind"] == TOKEN)) + 1  # every token is a node
    skipped = np.isin(positions, [p + n_tokens if p < 0 else p for p in skip])  # one out of range matches nothing
    neuron = np.flatnonzero((tables["node_kind"] == NEURON) & ~skipped)
    if neuron.size == 0:
        return
    keys = np.stack([tables["node_layer"][neuron], tables["node_index"][neuron]], axis=1)
    unique, first, which = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    which = which.reshape(-1)
    attribution = np.bincount(which, weights=out_weight[neuron], minlength=len(unique))
    order = np.argsort(which, kind="stable")
    bounds = np.cumsum(np.bincount(which, minlength=len(unique)))[:-1]
    activations = np.split(tables["node_activation"][neuron][order], bounds)
    labels = tables["node_label"][neuron[first]]
    for (layer, index), label, attr, acts in zip(unique.tolist(), labels.tolist(), attribution.tolist(), activations,
                                                 strict=True):
        yield (layer, index), str(label), float(attr), acts.tolist()
