"""A prompt's attribution graph as the store keeps it: circuit-tracer's graph JSON (schema_version 1) split into a
node table and a link table of named arrays (and, where it has them, its head loadings and QK records), and joined
back into exactly the same JSON object, both by the one schema (:mod:`detjac.graph_schema`); here, the store's
checks that the tables form a graph, so damaged data raises instead of reading back.

Pure numpy: the store never imports the engine. The layout is specified in ``docs/store-format.md`` ("The graph
group"); :func:`graph_tables` refuses a graph that would not read back equal, so whatever is stored reads back as
it was given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import StoreError
from ..graph_nodes import BIAS as BIAS_KIND
from ..graph_nodes import CONSTANT as CONSTANT_KIND
from ..graph_nodes import HEAD as HEAD_KIND
from ..graph_nodes import KINDS as NODE_KINDS
from ..graph_nodes import LOGIT as LOGIT_KIND
from ..graph_nodes import MLP as MLP_KIND
from ..graph_nodes import NEURON as NEURON_KIND
from ..graph_nodes import TOKEN as TOKEN_KIND
from ..graph_schema import (
    LINK_COLUMNS,
    LOADING_COLUMNS,
    NODE_COLUMNS,
    QK_COLUMNS,
    QK_ONLY,
    columns_json,
    graph_columns,
)
from ..graph_settings import crossed_layers

KINDS = tuple(kind.name for kind in NODE_KINDS)  # node_kind codes (the JSON's feature_type), as the group records
NEURON, TOKEN, LOGIT, BIAS = NEURON_KIND.code, TOKEN_KIND.code, LOGIT_KIND.code, BIAS_KIND.code
ARRAYS = {**NODE_COLUMNS, **LINK_COLUMNS}  # every graph has these; LOADING_COLUMNS a graph with head loadings
QK_ARRAYS = {QK_ONLY: "int8", **QK_COLUMNS}  # a graph with QK records (``--qk L.H``, graph version 2) has these
GRAPH_VERSION = 2  # the graph group's version: 1 (no attribute) before QK records and the kinds of QK-only nodes


def dimensions(name: str) -> tuple[str, ...]:
    """The dimension names of a graph array (:data:`ARRAYS`, :data:`~detjac.graph_schema.LOADING_COLUMNS`,
    :data:`QK_ARRAYS`)."""
    if name == "loaded_heads":
        return ("loaded", "loaded_layer", "loaded_head")
    if name.startswith("qk_"):
        return ("qk_record",) if name == "qk_node" else (name.rpartition("_")[0],)
    return ("loaded",) if name == "loaded_link" else ("node",) if name.startswith("node_") else ("link",)


def graph_tables(data: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays (:data:`ARRAYS`, and the optional ones) and group attributes (``metadata``, ``qParams``,
    ``kinds``, ``graph_version``) of a graph JSON, by the one schema (:func:`detjac.graph_schema.graph_columns`).

    Raises
    ------
    StoreError
        The object is not a graph JSON of the shape detjac writes, or would not read back equal to itself.
    """
    try:
        arrays, attrs = graph_columns(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"Expected a graph in circuit-tracer's JSON (nodes with node_id, feature_type, ...; links "
                         f"with source, target, weight). Got one that is not: {type(exc).__name__}: {exc}.") from exc
    attrs["graph_version"] = GRAPH_VERSION
    if graph_json(arrays, attrs) != data:
        raise StoreError("Expected a graph JSON whose nodes and links the store's tables hold exactly (docs/"
                         "store-format.md, 'The graph group'). Got one with keys or values they do not: nothing "
                         "was stored.")
    return arrays, attrs


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
    bad = [name for name in NODE_COLUMNS if np.shape(arrays[name]) != (n,)]
    bad += [name for name in LINK_COLUMNS if np.shape(arrays[name]) != (m,)]
    if bad:
        raise StoreError(f"Expected node arrays of {n} values and link arrays of {m}. Got {', '.join(bad)} of other "
                         "shapes.")
    kinds = arrays["node_kind"].tolist()
    if any(not 0 <= k < len(KINDS) for k in kinds):
        raise StoreError(f"Expected node kinds 0 to {len(KINDS) - 1} ({', '.join(KINDS)}). Got {sorted(set(kinds))}.")
    _check_codes(arrays)
    ends = np.r_[arrays["link_source"], arrays["link_target"]]
    if ends.size and (ends.min() < 0 or ends.max() >= n):
        raise StoreError(f"Expected links between the graph's {n} nodes. Got one to node {int(ends.max())}.")
    _check_loadings(arrays, m)
    _check_qk(arrays, n)
    return kinds


def _check_qk(arrays: dict[str, np.ndarray], n: int) -> None:
    """Refuse QK records that are not whole (every array of :data:`QK_ARRAYS` or none), name a record or a node
    that is not there, or mark QK-only nodes with anything but 0 and 1."""
    present = [name for name in QK_ARRAYS if name in arrays]
    if not present:
        return
    if QK_ONLY in arrays and (np.shape(arrays[QK_ONLY]) != (n,) or not np.isin(arrays[QK_ONLY], (0, 1)).all()):
        raise StoreError(f"Expected {QK_ONLY} of {n} values 0 or 1. Got shape {np.shape(arrays[QK_ONLY])}.")
    records = [name for name in QK_COLUMNS if name in arrays]
    if records and len(records) != len(QK_COLUMNS):
        raise StoreError(f"Expected every QK array ({', '.join(QK_COLUMNS)}) or none. Got only {', '.join(records)}.")
    if not records:
        return
    traced = arrays["qk_node"]
    for side in ("qk_pair", "qk_q", "qk_k"):
        names = [name for name in QK_COLUMNS if name.startswith(f"{side}_")]
        if len({np.shape(arrays[name]) for name in names}) != 1 or arrays[names[0]].ndim != 1:
            raise StoreError(f"Expected the arrays {', '.join(names)} of one length. Got shapes "
                             f"{[np.shape(arrays[name]) for name in names]}.")
        rows = arrays[f"{side}_record"]
        if rows.size and (rows.min() < 0 or rows.max() >= traced.size):
            raise StoreError(f"Expected QK rows of the graph's {traced.size} records. Got record {int(rows.max())}.")
    nodes = np.r_[traced, arrays["qk_pair_query"], arrays["qk_pair_key"], arrays["qk_q_node"], arrays["qk_k_node"]]
    if nodes.size and (nodes.min() < 0 or nodes.max() >= n):
        raise StoreError(f"Expected QK records naming the graph's {n} nodes. Got node {int(nodes.max())}.")


def _check_loadings(arrays: dict[str, np.ndarray], m: int) -> None:
    """Refuse head loadings that are not one row per loaded link, each link once, among the graph's ``m``."""
    present = [name for name in LOADING_COLUMNS if name in arrays]
    if not present:
        return
    if len(present) != len(LOADING_COLUMNS):
        raise StoreError(f"Expected both head-loading arrays ({', '.join(LOADING_COLUMNS)}) or neither. Got only "
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
        "heads with a negative layer or head, or a feature that is not the code of its (layer, head)":
            (kind == HEAD_KIND.code) & ((layer < 0) | (index < 0) | (feature != code)),
        "MLP totals or constants with a feature or index other than -1":
            np.isin(kind, (MLP_KIND.code, CONSTANT_KIND.code)) & ((feature != -1) | (index != -1)),
        "nodes at a negative position": position < 0,
    }
    for what, rows in wrong.items():
        if rows.any():
            first = int(np.flatnonzero(rows)[0])
            raise StoreError(f"Expected node columns that agree with each other. Got {int(rows.sum())} {what} "
                             f"(first: row {first}, layer {int(layer[first])}, index {int(index[first])}, feature "
                             f"{int(feature[first])}).")


def graph_json(arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> dict[str, Any]:
    """The graph JSON object from the stored arrays and attributes (the inverse of :func:`graph_tables`), by the one
    schema (:func:`detjac.graph_schema.columns_json`); a graph stored before QK records (version 1) reads as it was.

    Raises
    ------
    StoreError
        The arrays do not form a graph (:func:`check_tables`), or the group is of a later graph version.
    """
    version = attrs.get("graph_version", 1)
    if not isinstance(version, int) or not 1 <= version <= GRAPH_VERSION:
        raise StoreError(f"Expected a graph group of version 1 to {GRAPH_VERSION}. Got {version!r}: written by a later "
                         "detjac?")
    check_tables(arrays)
    return columns_json(arrays, attrs)
