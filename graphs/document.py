"""An attribution graph as circuit-tracer's graph JSON (schema_version 1), so its frontend and Neuronpedia open it.

Nodes are written by the one schema (:mod:`detjac.graph_schema`), their kinds and ids as :mod:`detjac.graph_nodes`
declares them, following circuit-tracer's conventions (``E_{token}_{pos}`` for tokens, ``{layer}_{index}_{pos}`` for
neurons, ``{n_layers + 1}_{token}_{pos}`` for logits; an affine family's bias nodes ``B_{layer}_{pos}``).
There are no error nodes: the graph is exact. A link whose head loadings were computed carries them as
``head_loadings`` (an extra field: circuit-tracer's models ignore it); every head's direct effect on each logit is
``metadata.info.head_effects``. Details: docs/graphs.md, "The JSON"."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from detjac import __version__
from detjac.graph_index import slug_of, write_graph_file
from detjac.graph_nodes import BIAS, HEAD, LOGIT, MLP, NEURON, TOKEN, TOKEN_LAYER, NodeKind, node_id
from detjac.graph_schema import NODE_COLUMNS, QK_ONLY, SCHEMA_VERSION, generator, nodes_json
from detjac.outputs import check_output

from .build import AttributionGraph
from .prune import EDGE_THRESHOLD, NODE_THRESHOLD, Pruned, prune
from .qk_records import record_of


def graph_dict(graph: AttributionGraph, *, slug: str, model: str, node_threshold: float = NODE_THRESHOLD,
               edge_threshold: float = EDGE_THRESHOLD, pruned: Pruned | None = None,
               identity: dict[str, Any] | None = None,
               supernodes: Sequence[tuple[str, Sequence[int]]] = ()) -> dict[str, Any]:
    """The graph, pruned (see :func:`~detjac.graphs.prune.prune`), as circuit-tracer's JSON object;
    ``identity`` (e.g. the model's ``weights_sha256``) joins its ``metadata.info``; ``supernodes`` ((label, neuron
    rows) each) become ``qParams.supernodes``, ``[label, node_id, ...]`` of each group's kept members (two or more)."""
    M, B, n = graph.n_neurons, graph.n_biases, graph.n_tokens
    if pruned is None and graph.pruned is not None and graph.pruned_at == (node_threshold, edge_threshold):
        pruned = graph.pruned  # the pruning the head loadings were chosen in
    kept = pruned if pruned is not None else prune(graph.adjacency, M, n, graph.logit_probabilities,
                                                   node_threshold, edge_threshold)
    rows, columns = _nodes(graph, kept)
    records = _add_qk(graph, columns)
    listed = nodes_json(columns, records)
    ids = {i: node["node_id"] for i, node in zip(rows, listed, strict=False)}
    targets, sources = np.nonzero(kept.edges)
    links = [{"source": ids[int(s)], "target": ids[int(t)], "weight": float(graph.adjacency[t, s])}
             for t, s in zip(targets, sources, strict=True) if int(s) in ids and int(t) in ids]
    _add_head_loadings(graph, links, ids)
    kept_cols = kept.nodes.copy()
    logit_rows = graph.layout.logits + np.arange(graph.n_logits)
    carried = (graph.adjacency[logit_rows][:, kept_cols].sum(1) / np.where(graph.logit_values != 0,
                                                                           graph.logit_values, 1.0))
    metadata = {
        "slug": slug, "scan": model, "transcoder_list": [], "prompt_tokens": list(graph.tokens),
        "prompt": "".join(graph.tokens), "node_threshold": node_threshold, "schema_version": SCHEMA_VERSION,
        "info": {"generator": generator(__version__), "exact": True, "error_nodes": 0, "edge_threshold": edge_threshold,
                 "completeness": graph.worst_completeness, "nodes_before_pruning": int(graph.adjacency.shape[0]),
                 "bias_nodes": B,
                 "active_neurons": graph.n_active, "logit_share_kept": [float(c) for c in carried],
                 **{k: v for k, v in graph.info.items() if isinstance(v, str | int | float | bool)},
                 "model": model, **(identity or {}),
                 **({"qk_nodes": len(listed) - len(rows)} if graph.qk else {}),
                 **({"target": graph.target} if graph.target is not None else {}),
                 **({"aside": list(graph.aside)} if graph.aside else {}),
                 **_contributions(graph, ids), **_head_effects(graph)},
    }
    groups = [[label, *(ids[int(m)] for m in rows if int(m) in ids)] for label, rows in supernodes]
    qparams = {"pinnedIds": [], "supernodes": [g for g in groups if len(g) > 2], "linkType": "both", "clickedId": "",
               "sg_pos": ""}
    return {"metadata": metadata, "qParams": qparams, "nodes": listed, "links": links}


def _contributions(graph: AttributionGraph, ids: dict[int, str]) -> dict[str, Any]:
    """``token_contributions``: each token's exact signed contribution to each logit node's value (``values``,
    logit node by logit node, in ``targets``' order) and the constants' (``constants``), summing to ``target_values``
    (docs/graphs.md, "Targets")."""
    if graph.token_contributions is None:
        return {}
    logit_rows = graph.layout.logits + np.arange(graph.n_logits)
    return {"token_contributions": {
        "targets": [ids[int(r)] for r in logit_rows], "target_values": [float(v) for v in graph.logit_values],
        "values": [[float(v) for v in row] for row in graph.token_contributions],
        "constants": [float(v) for v in graph.constants_contribution]}}


def _add_head_loadings(graph: AttributionGraph, links: list[dict[str, Any]], ids: dict[int, str]) -> None:
    """Each loaded link that the JSON shows gets its ``head_loadings`` (docs/graphs.md, "Head loadings")."""
    loaded = graph.head_loadings
    if loaded is None:
        return
    where = {(link["target"], link["source"]): link for link in links}
    for k, (t, s) in enumerate(loaded.links.tolist()):
        link = where.get((ids.get(t), ids.get(s)))
        if link is not None:
            link["head_loadings"] = loaded.of_link(k)


def _head_effects(graph: AttributionGraph) -> dict[str, Any]:
    """``{"head_effects": {"targets": [logit node ids], "values": K x n_layers x n_heads}}``: every head's direct
    effect on each logit (docs/graphs.md, "Direct effects of heads"); empty for a graph without them."""
    if graph.head_effects is None:
        return {}
    targets = [node_id(LOGIT, graph.n_layers + 1, t, graph.position) for t in graph.logit_ids]
    return {"head_effects": {"targets": targets, "values": graph.head_effects.tolist()}}


def _nodes(graph: AttributionGraph, kept: Pruned) -> tuple[list[int], dict[str, list[Any]]]:
    """The kept nodes (neurons and biases with an edge in or out; every token and logit): their rows of the
    adjacency and their columns (:data:`~detjac.graph_schema.NODE_COLUMNS`), for the one schema's writer."""
    at, L = graph.layout, graph.n_layers
    has_edge = kept.edges.any(axis=0) | kept.edges.any(axis=1)
    rows = [i for i in np.nonzero(kept.nodes)[0].tolist() if i >= at.tokens or has_edge[i]]
    columns: dict[str, list[Any]] = {name: [] for name in NODE_COLUMNS}
    nan = float("nan")
    for i in rows:
        kind, k = at.kind_of(i)
        act, prob = nan, nan
        if kind is NEURON:
            layer, index, pos = (int(v) for v in graph.neurons[k])
            label, act = graph.labels[k] if graph.labels else "", float(graph.activations[k])
        elif kind is BIAS:
            (layer, pos), index = (int(v) for v in graph.biases[k]), -1
            label = _label(graph, BIAS, layer, index, pos)
        elif kind is TOKEN:
            layer, index, pos, label = TOKEN_LAYER, graph.token_ids[k], k, graph.tokens[k]
        else:
            layer, index, pos = L + 1, graph.logit_ids[k], graph.position
            prob, act = float(graph.logit_probabilities[k]), float(graph.logit_values[k])
            minus = f' − "{graph.minus_token}"' if graph.minus_token is not None else ""
            label = f'Output "{graph.logit_tokens[k]}"{minus} (p={prob:.3f})'
        for name, value in zip(NODE_COLUMNS, (kind.code, layer, index, pos, kind.feature_of(layer, index, pos), act,
                                              float(kept.cumulative[i]), prob, label), strict=True):
            columns[name].append(value)
    columns[QK_ONLY] = [0] * len(rows)
    return rows, columns


def _label(graph: AttributionGraph, kind: NodeKind, layer: int, index: int, pos: int) -> str:
    """The clerp of a bias node or a QK component's node at ``pos``."""
    at = f"at “{graph.tokens[pos]}”"
    if kind is BIAS:
        return f"Bias: {'the final norm' if layer == graph.n_layers else f'layer {layer}'} {at}"
    if kind is HEAD:
        return f"L{layer}.H{index} output {at}"
    if kind is MLP:
        return f"Layer {layer} MLP output {at}"
    return f"Constants before layer 0 {at}" if layer < 0 else f"Layer {layer} query or key bias {at}"


def _add_qk(graph: AttributionGraph, columns: dict[str, list[Any]]) -> dict[int, dict[str, Any]]:
    """The graph's QK records (:mod:`detjac.graphs.qk_records`) on their heads' nodes, each added as a QK-only node,
    with their components' nodes that ``columns`` lacks added too; returns node row -> ``qk_tracing_results``."""
    where = {key: r for r, key in enumerate(zip(columns["node_kind"], columns["node_layer"], columns["node_index"],
                                                  columns["node_position"], strict=True))}
    nan = float("nan")

    def row(key: tuple[NodeKind, int, int, int], act: float = nan, label: str | None = None) -> int:
        kind, layer, index, pos = key
        code = (kind.code, layer, index, pos)
        if code not in where:
            where[code] = len(columns["node_kind"])
            values = (kind.code, layer, index, pos, kind.feature_of(layer, index, pos), act, 1.0, nan,
                      label or _label(graph, kind, layer, index, pos), 1)
            for name, value in zip([*NODE_COLUMNS, QK_ONLY], values, strict=True):
                columns[name].append(value)
        return where[code]

    out: dict[int, dict[str, Any]] = {}
    for qk in graph.qk:
        record = record_of(qk)
        _, layer, head, i = record["node"]
        j = record["key"]
        label = (f"L{layer}.H{head} at “{graph.tokens[i]}”: its score on key {j} “{graph.tokens[j]}” "
                 f"(p={record['probability']:.3f}), split into QK terms")
        traced = row(record["node"], record["score"], label)
        ids = lambda key: node_id(key[0], *key[1:])  # noqa: E731
        for key, _ in [*record["q"], *record["k"]]:
            row(key)
        out[traced] = {"pair_wise_contributors": [[ids(q), ids(k), v] for q, k, v in record["pairs"]],
                       "top_q_marginal_contributors": [[ids(key), v] for key, v in record["q"]],
                       "top_k_marginal_contributors": [[ids(key), v] for key, v in record["k"]]}
    return out


def write_graph(graph: AttributionGraph, out: str | Path, *, model: str, slug: str | None = None,
                node_threshold: float = NODE_THRESHOLD, edge_threshold: float = EDGE_THRESHOLD,
                force: bool = False, identity: dict[str, Any] | None = None,
                supernodes: Sequence[tuple[str, Sequence[int]]] = ()) -> dict[str, Any]:
    """Write the graph's JSON to ``out`` (written aside, then renamed) and add it to ``graph-metadata.json`` beside
    it (circuit-tracer's server lists the graphs of a folder from that file); return the JSON object.

    Raises
    ------
    InvalidArgumentError
        ``out`` is refused by :func:`detjac.outputs.check_output`: not a ``.json`` path, an existing file without
        ``force``, in a missing folder, inside a store or index.
    """
    path = check_output(out, force=force, suffix=".json")
    slug = slug or slug_of(path)
    data = graph_dict(graph, slug=slug, model=model, node_threshold=node_threshold, edge_threshold=edge_threshold,
                      identity=identity, supernodes=supernodes)
    write_graph_file(path, data)
    return data
