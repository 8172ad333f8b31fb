"""The node kinds of an attribution graph, each declared once (torch-free), and how a node is named.

A kind declares its name (the JSON's ``feature_type``), its code in the store's ``node_kind`` column, where its
nodes sit in the built graph's adjacency (``span``), the format of its ids (``node_id`` and circuit-tracer's
``jsNodeId``), its ``layer`` and ``feature`` in the JSON, the JSON fields it carries beyond the common ones, and its
label. Every node is the key ``(kind, layer, index, position)``: a neuron's index is its neuron, a token's and a
logit's their token id, a head's its head; ``-1`` where a kind has none. :func:`node_id` is the one place an id is
made, :func:`parse_node_id` the one place one is read. The schema that turns a graph into JSON and store tables and
back (:mod:`detjac.graph_schema`) and the viewer read these kinds; the engine's build orders its adjacency by
``span``.

Guarantees: ids are unique per key and read back to the same key (:func:`parse_node_id`); codes and names are
distinct. Not here: what a kind's value means numerically (docs/graphs.md, "Definitions").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TOKEN_LAYER = -1  # a token node's layer in the store ("E" in the JSON)


def cantor(x: int, y: int) -> int:
    """A unique integer for two non-negative integers (circuit-tracer's feature number of a (layer, index))."""
    return (x + y) * (x + y + 1) // 2 + y


@dataclass(frozen=True)
class NodeKind:
    """One kind of graph node (see the module docstring).

    Attributes
    ----------
    name : str
        The JSON's ``feature_type``.
    code : int
        The store's ``node_kind``.
    span : str
        Where the built graph keeps these nodes: ``neurons``, ``biases``, ``tokens``, ``logits`` (the adjacency's
        blocks, in that order), or ``qk`` (nodes the graph holds only to name QK terms).
    id_format, js_format : str
        ``str.format`` patterns over ``layer``, ``index`` and ``pos``.
    feature : str
        The JSON's ``feature``: ``cantor`` (of layer and index), ``index``, ``position`` or ``none`` (-1).
    fields : tuple[str, ...]
        The JSON fields beyond ``node_id``, ``feature``, ``layer``, ``ctx_idx``, ``feature_type``, ``jsNodeId``,
        ``clerp`` and ``influence`` (any node may also carry ``is_from_qk_tracing``, a node there only for QK
        terms, and ``qk_tracing_results``, a QK record: :mod:`detjac.graph_schema`).
    label : str
        What a reader calls one node of the kind.
    """

    name: str
    code: int
    span: str
    id_format: str
    js_format: str
    feature: str
    fields: tuple[str, ...]
    label: str

    def json_layer(self, layer: int) -> str:
        """The JSON's ``layer``: ``E`` for a token, the number as text otherwise (circuit-tracer's)."""
        return "E" if self.span == "tokens" else str(layer)

    def feature_of(self, layer: int, index: int, pos: int) -> int:
        return {"cantor": lambda: cantor(layer, index), "index": lambda: index, "position": lambda: pos,
                "none": lambda: -1}[self.feature]()


NEURON = NodeKind("mlp neuron", 0, "neurons", "{layer}_{index}_{pos}", "{layer}_{index}-0", "cantor", ("activation",),
                  "an MLP neuron of one layer at one position")
TOKEN = NodeKind("embedding", 1, "tokens", "E_{index}_{pos}", "E_{index}-{pos}", "position", (),
                 "an input token's embedding")
LOGIT = NodeKind("logit", 2, "logits", "{layer}_{index}_{pos}", "L_{index}-{pos}", "index",
                 ("token_prob", "is_target_logit", "activation"), "a target token's demeaned logit")
BIAS = NodeKind("bias", 3, "biases", "B_{layer}_{pos}", "B_{layer}-{pos}", "none", (),
                "an affine family's constants of one layer at one position")
HEAD = NodeKind("attention head", 4, "qk", "A_{layer}_{index}_{pos}", "A_{layer}_{index}-{pos}", "cantor",
                ("activation",), "one attention head at one position: a QK component (its output there), or the head "
                "a QK record explains at its query position (its activation: the score it explains)")
MLP = NodeKind("mlp", 5, "qk", "M_{layer}_{pos}", "M_{layer}-{pos}", "none", (),
               "one layer's whole MLP output at one position (a QK component)")
CONSTANT = NodeKind("constant", 6, "qk", "C_{layer}_{pos}", "C_{layer}-{pos}", "none", (),
                    "the constants a QK term reads at one position: before layer 0 (layer -1), or a traced head's "
                    "query or key bias (its layer)")

KINDS: tuple[NodeKind, ...] = (NEURON, TOKEN, LOGIT, BIAS, HEAD, MLP, CONSTANT)  # by code
BY_NAME = {kind.name: kind for kind in KINDS}
assert [k.code for k in KINDS] == list(range(len(KINDS)))  # the store's codes index this tuple


def kind_named(name: str) -> NodeKind | None:
    """The kind whose JSON ``feature_type`` is ``name`` (None: not one of detjac's)."""
    return BY_NAME.get(name)


def node_id(kind: NodeKind, layer: int, index: int, pos: int) -> str:
    """The one maker of node ids: ``kind``'s ``id_format`` over the node's key."""
    return kind.id_format.format(layer=layer, index=index, pos=pos)


def js_node_id(kind: NodeKind, layer: int, index: int, pos: int) -> str:
    """circuit-tracer's ``jsNodeId`` of the node (what its frontend groups a feature's positions by)."""
    return kind.js_format.format(layer=layer, index=index, pos=pos)


def _pattern(kind: NodeKind) -> re.Pattern[str]:
    parts = re.split(r"(\{\w+\})", kind.id_format)
    return re.compile("".join(f"(?P<{p[1:-1]}>-?\\d+)" if p.startswith("{") else re.escape(p) for p in parts) + "$")


_PATTERNS = {kind.name: _pattern(kind) for kind in KINDS}


def parse_node_id(kind: NodeKind, text: str) -> tuple[int, int, int] | None:
    """(layer, index, position) of the id ``text`` of a node of ``kind`` (index -1 where the id has none; a token's
    layer :data:`TOKEN_LAYER`); None when ``text`` is not such an id."""
    found = _PATTERNS[kind.name].match(text)
    if found is None:
        return None
    got = {k: int(v) for k, v in found.groupdict().items()}
    layer = TOKEN_LAYER if kind.span == "tokens" else got["layer"]
    return layer, got.get("index", -1), got["pos"]
