"""An attribution graph as circuit-tracer's graph JSON (schema_version 1), so its frontend and Neuronpedia open it.

Node ids follow circuit-tracer's conventions: ``E_{token}_{pos}`` for tokens, ``{layer}_{index}_{pos}`` for neurons,
``{n_layers + 1}_{token}_{pos}`` for logits; a neuron's ``feature`` is the Cantor pairing of (layer, index), its
``feature_type`` ``mlp neuron``. An affine family's bias nodes are ``B_{layer}_{pos}`` (``feature_type`` ``bias``).
There are no error nodes: the graph is exact. A link whose head loadings were computed carries them as
``head_loadings`` (an extra field: circuit-tracer's models ignore it). Details: docs/graphs.md, "The JSON"."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from detjac.graph_index import slug_of, write_graph_file
from detjac.outputs import check_output

from .build import AttributionGraph
from .prune import EDGE_THRESHOLD, NODE_THRESHOLD, Pruned, prune

SCHEMA_VERSION = 1
NEURON_TYPE = "mlp neuron"
BIAS_TYPE = "bias"  # an affine family's constants of one layer at one position (docs/graphs.md, "Bias nodes")


def cantor(x: int, y: int) -> int:
    """A unique integer for two non-negative integers (circuit-tracer's feature number of a (layer, index))."""
    return (x + y) * (x + y + 1) // 2 + y


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
    nodes = _nodes(graph, kept)
    ids = {i: node["node_id"] for i, node in nodes.items()}
    targets, sources = np.nonzero(kept.edges)
    links = [{"source": ids[int(s)], "target": ids[int(t)], "weight": float(graph.adjacency[t, s])}
             for t, s in zip(targets, sources, strict=True) if int(s) in ids and int(t) in ids]
    _add_head_loadings(graph, links, ids)
    kept_cols = kept.nodes.copy()
    logit_rows = M + B + n + np.arange(graph.n_logits)
    carried = (graph.adjacency[logit_rows][:, kept_cols].sum(1) / np.where(graph.logit_values != 0,
                                                                           graph.logit_values, 1.0))
    metadata = {
        "slug": slug, "scan": model, "transcoder_list": [], "prompt_tokens": list(graph.tokens),
        "prompt": "".join(graph.tokens), "node_threshold": node_threshold, "schema_version": SCHEMA_VERSION,
        "info": {"generator": "detjac", "exact": True, "error_nodes": 0, "edge_threshold": edge_threshold,
                 "completeness": graph.worst_completeness, "nodes_before_pruning": int(graph.adjacency.shape[0]),
                 "bias_nodes": B,
                 "active_neurons": graph.n_active, "logit_share_kept": [float(c) for c in carried],
                 **{k: v for k, v in graph.info.items() if isinstance(v, str | int | float | bool)},
                 "model": model, **(identity or {})},
    }
    groups = [[label, *(ids[int(m)] for m in rows if int(m) in ids)] for label, rows in supernodes]
    qparams = {"pinnedIds": [], "supernodes": [g for g in groups if len(g) > 2], "linkType": "both", "clickedId": "",
               "sg_pos": ""}
    return {"metadata": metadata, "qParams": qparams, "nodes": list(nodes.values()), "links": links}


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


def _nodes(graph: AttributionGraph, kept: Pruned) -> dict[int, dict[str, Any]]:
    M, B, n, L = graph.n_neurons, graph.n_biases, graph.n_tokens, graph.n_layers
    out: dict[int, dict[str, Any]] = {}
    has_edge = kept.edges.any(axis=0) | kept.edges.any(axis=1)
    for i in np.nonzero(kept.nodes)[0].tolist():
        score = float(kept.cumulative[i])
        if i < M:
            if not has_edge[i]:
                continue
            layer, index, pos = (int(v) for v in graph.neurons[i])
            out[i] = {"node_id": f"{layer}_{index}_{pos}", "feature": cantor(layer, index), "layer": str(layer),
                      "ctx_idx": pos, "feature_type": NEURON_TYPE, "jsNodeId": f"{layer}_{index}-0",
                      "clerp": graph.labels[i] if graph.labels else "", "influence": score,
                      "activation": float(graph.activations[i])}
        elif i < M + B:
            if not has_edge[i]:
                continue
            layer, pos = (int(v) for v in graph.biases[i - M])
            where = "the final norm" if layer == L else f"layer {layer}"
            out[i] = {"node_id": f"B_{layer}_{pos}", "feature": -1, "layer": str(layer), "ctx_idx": pos,
                      "feature_type": BIAS_TYPE, "jsNodeId": f"B_{layer}-{pos}",
                      "clerp": f"Bias: {where} at “{graph.tokens[pos]}”", "influence": score}
        elif i < M + B + n:
            pos = i - M - B
            token = graph.token_ids[pos]
            out[i] = {"node_id": f"E_{token}_{pos}", "feature": pos, "layer": "E", "ctx_idx": pos,
                      "feature_type": "embedding", "jsNodeId": f"E_{token}-{pos}", "clerp": graph.tokens[pos],
                      "influence": score}
        else:
            k = i - M - B - n
            token, prob = graph.logit_ids[k], float(graph.logit_probabilities[k])
            out[i] = {"node_id": f"{L + 1}_{token}_{graph.position}", "feature": token, "layer": str(L + 1),
                      "ctx_idx": graph.position, "feature_type": "logit", "token_prob": prob,
                      "is_target_logit": k == 0, "jsNodeId": f"L_{token}-{graph.position}",
                      "clerp": f'Output "{graph.logit_tokens[k]}" (p={prob:.3f})', "influence": score,
                      "activation": float(graph.logit_values[k])}
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
