"""A prompt's attribution graph as the store keeps it: circuit-tracer's graph JSON (schema_version 1) split into a
node table and a link table of named arrays, and joined back into exactly the same JSON object.

Pure numpy: the store never imports the engine. The layout is specified in ``docs/store-format.md`` ("The graph
group"); :func:`graph_tables` refuses a graph that would not read back equal, so whatever is stored reads back as
it was given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import StoreError
from ..graph_settings import crossed_layers

KINDS = ("mlp neuron", "embedding", "logit", "bias")  # node_kind codes 0-3 (the JSON's feature_type)
NEURON, TOKEN, LOGIT, BIAS = range(4)
TOKEN_LAYER = -1  # a token node's layer ("E" in the JSON)
NODE_ARRAYS = {  # name -> dtype; dimension "node", rows in the JSON's node order
    "node_kind": "int8", "node_layer": "int64", "node_index": "int64", "node_position": "int64",
    "node_feature": "int64", "node_activation": "float64", "node_influence": "float64",
    "node_probability": "float64", "node_label": "str",
}
LINK_ARRAYS = {"link_source": "int64", "link_target": "int64", "link_weight": "float64"}  # dimension "link"
ARRAYS = {**NODE_ARRAYS, **LINK_ARRAYS}
# a graph whose strongest links carry head loadings (``detjac run --graph --heads N``) has these too: which links
# (rows of the link arrays), and each one's loadings per layer and head, the skip last (NaN: a layer not crossed)
LOADING_ARRAYS = {"loaded_link": "int64", "loaded_heads": "float64"}
SKIP = "skip"


def dimensions(name: str) -> tuple[str, ...]:
    """The dimension names of a graph array (:data:`ARRAYS`, :data:`LOADING_ARRAYS`)."""
    if name == "loaded_heads":
        return ("loaded", "loaded_layer", "loaded_head")
    return ("loaded",) if name == "loaded_link" else ("node",) if name.startswith("node_") else ("link",)


def graph_tables(data: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays (:data:`ARRAYS`) and group attributes (``metadata``, ``qParams``, ``kinds``) of a graph JSON.

    Raises
    ------
    StoreError
        The object is not a graph JSON of the shape detjac writes, or would not read back equal to itself.
    """
    try:
        nodes, links = data["nodes"], data["links"]
        arrays = _node_arrays(nodes)
        row = {node["node_id"]: i for i, node in enumerate(nodes)}
        arrays["link_source"] = np.asarray([row[link["source"]] for link in links], dtype=np.int64)
        arrays["link_target"] = np.asarray([row[link["target"]] for link in links], dtype=np.int64)
        arrays["link_weight"] = np.asarray([link["weight"] for link in links], dtype=np.float64)
        arrays.update(_loading_arrays(links))
        attrs = {"metadata": data["metadata"], "qParams": data["qParams"], "kinds": list(KINDS)}
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"Expected a graph in circuit-tracer's JSON (nodes with node_id, feature_type, ...; links "
                         f"with source, target, weight). Got one that is not: {type(exc).__name__}: {exc}.") from exc
    if graph_json(arrays, attrs) != data:
        raise StoreError("Expected a graph JSON whose nodes and links the store's tables hold exactly (docs/"
                         "store-format.md, 'The graph group'). Got one with keys or values they do not: nothing "
                         "was stored.")
    return arrays, attrs


def _loading_arrays(links: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The links' ``head_loadings`` as :data:`LOADING_ARRAYS` (none when no link has them)."""
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


def _node_arrays(nodes: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    kind = [KINDS.index(node["feature_type"]) for node in nodes]
    parts = [node["node_id"].split("_") for node in nodes]
    nan = float("nan")
    return {
        "node_kind": np.asarray(kind, dtype=np.int8),
        "node_layer": np.asarray([TOKEN_LAYER if k == TOKEN else int(p[1]) if k == BIAS else int(p[0])
                                  for k, p in zip(kind, parts, strict=True)], dtype=np.int64),
        "node_index": np.asarray([-1 if k == BIAS else int(p[1]) for k, p in zip(kind, parts, strict=True)],
                                 dtype=np.int64),
        "node_position": np.asarray([node["ctx_idx"] for node in nodes], dtype=np.int64),
        "node_feature": np.asarray([node["feature"] for node in nodes], dtype=np.int64),
        "node_activation": np.asarray([node.get("activation", nan) for node in nodes], dtype=np.float64),
        "node_influence": np.asarray([node["influence"] for node in nodes], dtype=np.float64),
        "node_probability": np.asarray([node.get("token_prob", nan) for node in nodes], dtype=np.float64),
        "node_label": np.asarray([node["clerp"] for node in nodes], dtype=str),
    }


def check_tables(arrays: dict[str, np.ndarray]) -> list[int]:
    """Refuse arrays that do not form a graph; return the node kinds.

    Raises
    ------
    StoreError
        An array missing, node arrays of different lengths, an unknown node kind, a link to a node that is not there.
    """
    missing = sorted(set(ARRAYS) - set(arrays))
    if missing:
        raise StoreError(f"Expected every array of a stored graph ({', '.join(ARRAYS)}). Got none for "
                         f"{', '.join(missing)}.")
    n = len(arrays["node_kind"])
    m = len(arrays["link_weight"])
    bad = [name for name in NODE_ARRAYS if np.shape(arrays[name]) != (n,)]
    bad += [name for name in LINK_ARRAYS if np.shape(arrays[name]) != (m,)]
    if bad:
        raise StoreError(f"Expected node arrays of {n} values and link arrays of {m}. Got {', '.join(bad)} of other "
                         "shapes.")
    kinds = arrays["node_kind"].tolist()
    if any(k not in (NEURON, TOKEN, LOGIT, BIAS) for k in kinds):
        raise StoreError(f"Expected node kinds 0 to 3 ({', '.join(KINDS)}). Got {sorted(set(kinds))}.")
    _check_codes(arrays)
    ends = np.r_[arrays["link_source"], arrays["link_target"]]
    if ends.size and (ends.min() < 0 or ends.max() >= n):
        raise StoreError(f"Expected links between the graph's {n} nodes. Got one to node {int(ends.max())}.")
    _check_loadings(arrays, m)
    return kinds


def _check_loadings(arrays: dict[str, np.ndarray], m: int) -> None:
    """Refuse head loadings that are not one row per loaded link, each link once, among the graph's ``m``."""
    present = [name for name in LOADING_ARRAYS if name in arrays]
    if not present:
        return
    if len(present) != len(LOADING_ARRAYS):
        raise StoreError(f"Expected both head-loading arrays ({', '.join(LOADING_ARRAYS)}) or neither. Got only "
                         f"{present[0]}.")
    which, values = arrays["loaded_link"], arrays["loaded_heads"]
    if which.ndim != 1 or values.ndim != 3 or values.shape[0] != which.shape[0]:
        raise StoreError(f"Expected loaded_link (loaded,) and loaded_heads (loaded, layer, head + 1). Got shapes "
                         f"{which.shape} and {values.shape}.")
    if which.size and (which.min() < 0 or which.max() >= m or np.unique(which).size != which.size):
        raise StoreError(f"Expected head loadings of distinct links among the graph's {m}. Got links "
                         f"{int(which.min())} to {int(which.max())}, {which.size - np.unique(which).size} repeated.")
    _check_crossed(arrays, which, values)


def _check_crossed(arrays: dict[str, np.ndarray], which: np.ndarray, values: np.ndarray) -> None:
    """Refuse loadings that would read back as another split (NaN marks a layer the link does not cross): a row of
    a layer partly NaN, NaN on a layer the link crosses (it would read as crossing fewer layers, or none), numbers
    on a layer it does not cross (:func:`detjac.graph_settings.crossed_layers`; the model's layer count is a
    logit's layer less one)."""
    kind, layer = arrays["node_kind"], arrays["node_layer"]
    logits = layer[kind == LOGIT]
    n_layers = int(logits[0]) - 1 if logits.size else None
    nan = np.isnan(values)  # (loaded, layer, head + 1)
    for i, k in enumerate(which.tolist()):
        ends = [(KINDS[kind[x]], int(layer[x]) if kind[x] == NEURON else None)
                for x in (int(arrays["link_source"][k]), int(arrays["link_target"][k]))]
        crossed = crossed_layers(ends[0], ends[1], n_layers)
        partly = np.flatnonzero(nan[i].any(1) & ~nan[i].all(1))
        wanted = np.zeros(max(values.shape[1], crossed.stop if crossed else 0), dtype=bool)
        if crossed is not None:
            wanted[crossed.start:crossed.stop] = True
        held = np.r_[~nan[i].all(1), np.zeros(wanted.size - values.shape[1], dtype=bool)]
        missing = np.flatnonzero(wanted & ~held) if crossed is not None else []
        extra = np.flatnonzero(~wanted & held) if crossed is not None else []
        for rows, what in ((partly, "a NaN among the loadings of layer"), (missing, "no loadings (NaN) at layer"),
                           (extra, "loadings at layer")):
            if len(rows):
                raise StoreError(f"Expected head loadings on every head of exactly the layers each loaded link "
                                 f"crosses. Got {what} {int(rows[0])} of link {k} ({ends[0][0]} to {ends[1][0]}, "
                                 f"crossing {_span(crossed)}): the graph is damaged.")


def _span(crossed: range | None) -> str:
    return "an unknown span" if crossed is None else "no layer" if not crossed else \
        f"layers {crossed.start} to {crossed.stop - 1}"


def _check_codes(arrays: dict[str, np.ndarray]) -> None:
    """Refuse node rows whose columns contradict each other (what a swap of two equal-sized arrays gives): a
    neuron's feature is the Cantor code of its (layer, index), both non-negative; a token's feature is its
    position; a logit's feature is its token id and its probability is in [0, 1]; a bias has feature and index -1."""
    kind, layer, index = arrays["node_kind"], arrays["node_layer"], arrays["node_index"]
    feature, position, prob = arrays["node_feature"], arrays["node_position"], arrays["node_probability"]
    neuron, token, logit, bias = (kind == NEURON), (kind == TOKEN), (kind == LOGIT), (kind == BIAS)
    with np.errstate(over="ignore"):
        code = (layer + index) * (layer + index + 1) // 2 + index
    wrong = {
        "neurons with a negative layer or index, or a feature that is not the code of its (layer, index)":
            neuron & ((layer < 0) | (index < 0) | (feature != code)),
        "tokens whose feature is not their position": token & (feature != position),
        "logits whose feature is not their token, or with a probability outside [0, 1]":
            logit & ((feature != index) | ~((prob >= 0) & (prob <= 1))),
        "biases with a feature or index other than -1": bias & ((feature != -1) | (index != -1)),
        "nodes at a negative position": position < 0,
    }
    for what, rows in wrong.items():
        if rows.any():
            first = int(np.flatnonzero(rows)[0])
            raise StoreError(f"Expected node columns that agree with each other. Got {int(rows.sum())} {what} "
                             f"(first: row {first}, layer {int(layer[first])}, index {int(index[first])}, feature "
                             f"{int(feature[first])}).")


def graph_json(arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> dict[str, Any]:
    """The graph JSON object from the stored arrays and attributes (the inverse of :func:`graph_tables`).

    Raises
    ------
    StoreError
        The arrays do not form a graph (:func:`check_tables`).
    """
    kinds = check_tables(arrays)
    columns = zip(kinds, *(arrays[name].tolist() for name in list(NODE_ARRAYS)[1:]), strict=True)
    nodes = []
    first_logit = True
    for kind, layer, index, pos, feature, act, influence, prob, label in columns:
        node: dict[str, Any]
        if kind == NEURON:
            node = {"node_id": f"{layer}_{index}_{pos}", "feature": feature, "layer": str(layer), "ctx_idx": pos,
                    "feature_type": KINDS[kind], "jsNodeId": f"{layer}_{index}-0", "clerp": label,
                    "influence": influence, "activation": act}
        elif kind == BIAS:
            node = {"node_id": f"B_{layer}_{pos}", "feature": feature, "layer": str(layer), "ctx_idx": pos,
                    "feature_type": KINDS[kind], "jsNodeId": f"B_{layer}-{pos}", "clerp": label,
                    "influence": influence}
        elif kind == TOKEN:
            node = {"node_id": f"E_{index}_{pos}", "feature": feature, "layer": "E", "ctx_idx": pos,
                    "feature_type": KINDS[kind], "jsNodeId": f"E_{index}-{pos}", "clerp": label,
                    "influence": influence}
        else:
            node = {"node_id": f"{layer}_{index}_{pos}", "feature": feature, "layer": str(layer), "ctx_idx": pos,
                    "feature_type": KINDS[kind], "token_prob": prob, "is_target_logit": first_logit,
                    "jsNodeId": f"L_{index}-{pos}", "clerp": label, "influence": influence, "activation": act}
            first_logit = False
        nodes.append(node)
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
