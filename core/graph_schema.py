"""The one schema of an attribution graph: node columns <-> circuit-tracer's graph JSON <-> the store's tables.

A graph's nodes are columns (:data:`NODE_COLUMNS`: each node's kind code, layer, index, position, feature,
activation, influence, probability, label, and whether it is there only for QK terms), its links three more
(:data:`LINK_COLUMNS`), a link's head loadings two (:data:`LOADING_COLUMNS`) and the QK records of the heads traced
(:data:`QK_COLUMNS`). :func:`nodes_json` is the one writer of JSON nodes (the graphs layer writes a built graph
through it, the store a stored one) and :func:`graph_columns` / :func:`columns_json` convert a whole graph JSON to
columns and back. Node kinds, ids and fields come from :mod:`detjac.graph_nodes`. Torch-free, numpy only.

Guarantees: ``columns_json(*graph_columns(data)) == data`` for every graph detjac writes (the store checks it
before anything is written). Not here: whether the columns are consistent (the store's checks,
:mod:`detjac.store.graph_tables`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .graph_nodes import KINDS, LOGIT, TOKEN_LAYER, js_node_id, kind_named, node_id, parse_node_id

SCHEMA_VERSION = 1  # circuit-tracer's graph JSON
# metadata.info.generator (with the version): detjac has no public repository yet; the url names the method's paper
GENERATOR = {"name": "detjac", "url": "https://arxiv.org/abs/2505.24293"}
NODE_COLUMNS = {  # name -> dtype; dimension "node", rows in the JSON's node order
    "node_kind": "int8", "node_layer": "int64", "node_index": "int64", "node_position": "int64",
    "node_feature": "int64", "node_activation": "float64", "node_influence": "float64",
    "node_probability": "float64", "node_label": "str",
}
QK_ONLY = "node_qk_only"  # int8 (1: a node there only to name QK terms); absent from graphs stored before it
LINK_COLUMNS = {"link_source": "int64", "link_target": "int64", "link_weight": "float64"}  # dimension "link"
# the strongest links' head loadings (``--heads N``): which links (rows of the link columns), and each one's loadings
# per layer and head, the skip last (NaN: a layer not crossed)
LOADING_COLUMNS = {"loaded_link": "int64", "loaded_heads": "float64"}
SKIP = "skip"
# QK records (``--qk L.H``): the traced node of each record; its pairs (query node, key node, attribution) and each
# side's marginals (node, attribution), each row naming its record
QK_COLUMNS = {"qk_node": "int64", "qk_pair_record": "int64", "qk_pair_query": "int64", "qk_pair_key": "int64",
              "qk_pair_value": "float64", "qk_q_record": "int64", "qk_q_node": "int64", "qk_q_value": "float64",
              "qk_k_record": "int64", "qk_k_node": "int64", "qk_k_value": "float64"}
QK_RESULTS = "qk_tracing_results"
QK_LISTS = (("pair_wise_contributors", "qk_pair"), ("top_q_marginal_contributors", "qk_q"),
            ("top_k_marginal_contributors", "qk_k"))


def generator(version: str) -> dict[str, str]:
    """``metadata.info.generator`` as Neuronpedia's graph schema wants it: an object with name, version and url."""
    return {"name": GENERATOR["name"], "version": version, "url": GENERATOR["url"]}


def nodes_json(columns: Mapping[str, Sequence[Any]], qk: Mapping[int, dict[str, Any]] | None = None
               ) -> list[dict[str, Any]]:
    """The JSON nodes of ``columns`` (:data:`NODE_COLUMNS`, :data:`QK_ONLY` optional), in their order: each kind's
    id, ``jsNodeId``, layer and fields (:mod:`detjac.graph_nodes`); the first logit is the target logit. ``qk``:
    row -> its ``qk_tracing_results``."""
    n = len(columns["node_kind"])
    qk_only = columns.get(QK_ONLY, [0] * n)
    nodes, first_logit = [], True
    rows = zip(*(columns[name] for name in NODE_COLUMNS), qk_only, strict=True)
    for row, (code, layer, index, pos, feature, act, influence, prob, label, only) in enumerate(rows):
        kind = KINDS[int(code)]
        node: dict[str, Any] = {"node_id": node_id(kind, layer, index, pos), "feature": feature,
                                "layer": kind.json_layer(layer), "ctx_idx": pos, "feature_type": kind.name}
        if kind is LOGIT:
            node.update(token_prob=prob, is_target_logit=first_logit)
            first_logit = False
        node.update(jsNodeId=js_node_id(kind, layer, index, pos), clerp=label, influence=influence)
        if "activation" in kind.fields and act == act:  # NaN: a QK component's head node has no value of its own
            node["activation"] = act
        if only:
            node["is_from_qk_tracing"] = True
        if qk and row in qk:
            node[QK_RESULTS] = qk[row]
        nodes.append(node)
    return nodes


def node_columns(nodes: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The columns of JSON ``nodes`` (the inverse of :func:`nodes_json`).

    Raises
    ------
    KeyError, TypeError, ValueError
        A node without a field its kind needs, of an unknown kind, or whose id is not its kind's.
    """
    keys = []
    for node in nodes:
        kind = kind_named(node["feature_type"])
        key = parse_node_id(kind, node["node_id"]) if kind is not None else None
        if kind is None or key is None:
            raise ValueError(f"a node {node['node_id']!r} of kind {node['feature_type']!r}")
        keys.append((kind.code, *key))
    nan = float("nan")
    out = {
        "node_kind": np.asarray([k[0] for k in keys], dtype=np.int8),
        "node_layer": np.asarray([k[1] for k in keys], dtype=np.int64),
        "node_index": np.asarray([k[2] for k in keys], dtype=np.int64),
        "node_position": np.asarray([node["ctx_idx"] for node in nodes], dtype=np.int64),
        "node_feature": np.asarray([node["feature"] for node in nodes], dtype=np.int64),
        "node_activation": np.asarray([node.get("activation", nan) for node in nodes], dtype=np.float64),
        "node_influence": np.asarray([node["influence"] for node in nodes], dtype=np.float64),
        "node_probability": np.asarray([node.get("token_prob", nan) for node in nodes], dtype=np.float64),
        "node_label": np.asarray([node["clerp"] for node in nodes], dtype=str),
    }
    if any(node.get("is_from_qk_tracing") for node in nodes):
        out[QK_ONLY] = np.asarray([bool(node.get("is_from_qk_tracing")) for node in nodes], dtype=np.int8)
    return out


def graph_columns(data: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The columns and the attributes (``metadata``, ``qParams``, ``kinds``) of a graph JSON.

    Raises
    ------
    KeyError, TypeError, ValueError
        ``data`` is not a graph JSON of the shape detjac writes.
    """
    nodes, links = data["nodes"], data["links"]
    arrays = node_columns(nodes)
    row = {node["node_id"]: i for i, node in enumerate(nodes)}
    arrays["link_source"] = np.asarray([row[link["source"]] for link in links], dtype=np.int64)
    arrays["link_target"] = np.asarray([row[link["target"]] for link in links], dtype=np.int64)
    arrays["link_weight"] = np.asarray([link["weight"] for link in links], dtype=np.float64)
    arrays.update(_loading_columns(links))
    arrays.update(_qk_columns(nodes, row))
    return arrays, {"metadata": data["metadata"], "qParams": data["qParams"], "kinds": [k.name for k in KINDS]}


def columns_json(arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The graph JSON object of ``arrays`` and ``attrs`` (the inverse of :func:`graph_columns`); the columns are
    taken as consistent (the store checks them first)."""
    columns = {name: arrays[name].tolist() for name in [*NODE_COLUMNS, *([QK_ONLY] if QK_ONLY in arrays else [])]}
    nodes = nodes_json(columns, _qk_records(arrays, columns))
    ids = [node["node_id"] for node in nodes]
    links = [{"source": ids[s], "target": ids[t], "weight": w} for s, t, w in
             zip(arrays["link_source"].tolist(), arrays["link_target"].tolist(), arrays["link_weight"].tolist(),
                 strict=True)]
    if "loaded_link" in arrays:
        heads = arrays["loaded_heads"].shape[2] - 1
        for k, rows in zip(arrays["loaded_link"].tolist(), arrays["loaded_heads"].tolist(), strict=True):
            links[k]["head_loadings"] = {str(layer): {**{str(h): row[h] for h in range(heads)}, SKIP: row[heads]}
                                         for layer, row in enumerate(rows) if not all(np.isnan(row))}
    return {"metadata": attrs.get("metadata"), "qParams": attrs.get("qParams"), "nodes": nodes, "links": links}


def _loading_columns(links: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The links' ``head_loadings`` as :data:`LOADING_COLUMNS` (none when no link has them)."""
    loaded = [k for k, link in enumerate(links) if "head_loadings" in link]
    if not loaded:
        return {}
    rows = [links[k]["head_loadings"] for k in loaded]
    layers = 1 + max((int(layer) for row in rows for layer in row), default=-1)
    heads = max((len(per) - 1 for row in rows for per in row.values()), default=0)
    out = np.full((len(loaded), layers, heads + 1), np.nan)
    for i, row in enumerate(rows):
        for layer, per in row.items():
            out[i, int(layer)] = [per[str(h)] for h in range(heads)] + [per[SKIP]]
    return {"loaded_link": np.asarray(loaded, dtype=np.int64), "loaded_heads": out}


def _qk_columns(nodes: Sequence[dict[str, Any]], row: Mapping[str, int]) -> dict[str, np.ndarray]:
    """The nodes' ``qk_tracing_results`` as :data:`QK_COLUMNS` (none when no node has them)."""
    traced = [i for i, node in enumerate(nodes) if QK_RESULTS in node]
    if not traced:
        return {}
    out: dict[str, list[Any]] = {name: [] for name in QK_COLUMNS}
    out["qk_node"] = traced
    for record, i in enumerate(traced):
        results = nodes[i][QK_RESULTS]
        for q, k, value in results["pair_wise_contributors"]:
            out["qk_pair_record"].append(record)
            out["qk_pair_query"].append(row[q])
            out["qk_pair_key"].append(row[k])
            out["qk_pair_value"].append(value)
        for key, prefix in QK_LISTS[1:]:
            for node, value in results[key]:
                out[f"{prefix}_record"].append(record)
                out[f"{prefix}_node"].append(row[node])
                out[f"{prefix}_value"].append(value)
    return {name: np.asarray(values, dtype=QK_COLUMNS[name]) for name, values in out.items()}


def _qk_records(arrays: Mapping[str, np.ndarray], columns: Mapping[str, list[Any]]) -> dict[int, dict[str, Any]]:
    """Node row -> its ``qk_tracing_results``, from :data:`QK_COLUMNS` (none in a graph without them)."""
    if "qk_node" not in arrays:
        return {}
    ids = [node_id(KINDS[c], layer, index, pos) for c, layer, index, pos in
           zip(columns["node_kind"], columns["node_layer"], columns["node_index"], columns["node_position"],
               strict=True)]
    out: dict[int, dict[str, Any]] = {}
    for record, node in enumerate(arrays["qk_node"].tolist()):
        pairs = [[ids[q], ids[k], v] for r, q, k, v in
                 zip(*(arrays[f"qk_pair_{c}"].tolist() for c in ("record", "query", "key", "value")), strict=True)
                 if r == record]
        sides = {key: [[ids[i], v] for r, i, v in zip(*(arrays[f"{prefix}_{c}"].tolist()
                                                           for c in ("record", "node", "value")), strict=True)
                       if r == record] for key, prefix in QK_LISTS[1:]}
        out[int(node)] = {"pair_wise_contributors": pairs, **sides}
    return out


__all__ = ["GENERATOR", "LINK_COLUMNS", "LOADING_COLUMNS", "NODE_COLUMNS", "QK_COLUMNS", "QK_ONLY", "SCHEMA_VERSION",
           "SKIP", "TOKEN_LAYER", "columns_json", "generator", "graph_columns", "node_columns", "nodes_json"]
