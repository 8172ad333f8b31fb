"""The corpus question of stored attribution graphs (``detjac run --graph``): which MLP neurons recur across the
prompts' graphs, with their labels, in how many graphs they appear and their mean attribution.

Reads each prompt's graph through the store's public API (:meth:`detjac.store.StoredPrompt.graph`, the circuit-tracer
JSON object) and counts in numpy. Definitions: docs/graphs.md, "In the store".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from ..store import StoreReader

NEURON = "mlp neuron"  # a neuron node's feature_type in the graph JSON


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
    table : Path or None
        The table written, if any.
    """

    rows: list[dict[str, Any]]
    n_graphs: int
    without_graph: list[str] = field(default_factory=list)
    table: Path | None = None


def recurring_neurons(store: StoreReader, prompt_ids: Iterable[str] | None = None, *, min_graphs: int = 1,
                      table: str | Path | None = None, progress: Any = None) -> GraphNeurons:
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
    table
        Also write the rows here: Parquet for a ``.parquet`` suffix, else CSV (``prompt_ids`` space-separated).
    progress
        A tqdm-like bar, updated once per prompt.

    Raises
    ------
    InvalidArgumentError
        ``min_graphs`` below 1, or none of the prompts has a graph (a store written without ``--graph``).
    """
    if isinstance(min_graphs, bool) or not isinstance(min_graphs, int) or min_graphs < 1:
        raise InvalidArgumentError(f"Expected min_graphs to be a positive integer. Got {min_graphs!r}.")
    ids = list(store.prompt_ids() if prompt_ids is None else prompt_ids)
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    without: list[str] = []
    n_graphs = 0
    for pid in ids:
        graph = store.get(pid).graph()
        if progress is not None:
            progress.update()
        if graph is None:
            without.append(pid)
            continue
        n_graphs += 1
        for key, found in _neurons_of(graph).items():
            entry = seen.setdefault(key, {"label": found["label"], "prompt_ids": [], "attribution": [],
                                          "activations": []})
            entry["prompt_ids"].append(pid)
            entry["attribution"].append(found["attribution"])
            entry["activations"].extend(found["activations"])
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
    return GraphNeurons(rows, n_graphs, without, written)


def _neurons_of(graph: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
    """Each neuron of one graph JSON: its label, the activations of its nodes, the sum of its outgoing links."""
    out_weight: dict[str, float] = {}
    for link in graph["links"]:
        out_weight[link["source"]] = out_weight.get(link["source"], 0.0) + float(link["weight"])
    found: dict[tuple[int, int], dict[str, Any]] = {}
    for node in graph["nodes"]:
        if node.get("feature_type") != NEURON:
            continue
        layer, index, _ = (int(part) for part in node["node_id"].split("_"))
        entry = found.setdefault((layer, index), {"label": node.get("clerp", ""), "activations": [],
                                                  "attribution": 0.0})
        entry["activations"].append(float(node["activation"]))
        entry["attribution"] += out_weight.get(node["node_id"], 0.0)
    return found
