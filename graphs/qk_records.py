"""QK records: the exact QK attribution of the heads a user asks for (``--qk L.H``), carried by the graph JSON in
Neuronpedia's form (docs/graphs.md, "QK records").

For each head ``(L, H)`` the build computes :func:`detjac.engine.qk_attribution` at the predicted position ``i``
(:func:`qk_phase`). The record explains the score of the key ``j`` the head attends to most: on the head's node at
``i`` (``A_{L}_{H}_{i}``, its activation that score), ``pair_wise_contributors`` lists the strongest
:data:`QK_PAIRS` terms ``[query node id, key node id, term]``, and ``top_q_marginal_contributors`` and
``top_k_marginal_contributors`` every component's marginal ``[node id, sum]`` on each side, each list summing to
the score exactly. Components name nodes (:func:`component_key`): a token's embedding is its token node, a head's
output an ``attention head`` node, a layer's MLP output an ``mlp`` node, a layer's constants its ``bias`` node, the
constants before layer 0 and the head's own query or key bias ``constant`` nodes; those the pruned graph does not
hold are added as QK-only nodes (``is_from_qk_tracing``)."""

from __future__ import annotations

import re
from typing import Any

from detjac.engine import Engine, StreamedEngine, qk_attribution
from detjac.errors import InvalidArgumentError
from detjac.graph_nodes import BIAS, CONSTANT, HEAD, MLP, TOKEN, TOKEN_LAYER, NodeKind

QK_PAIRS = 20  # the strongest pair terms a record lists (its marginals list every component)
_HEAD = re.compile(r"A(\d+)\.(\d+)$")
_NUMBERED = re.compile(r"([MB])(\d+)$")


def check_qk(engine: Engine, heads: tuple[tuple[int, int], ...]) -> None:
    """Refuse, before any work, heads the engine cannot trace (out of range, or a layer-streamed engine).

    Raises
    ------
    InvalidArgumentError
        A layer or head out of range, or a layer-streamed engine (QK attribution needs the whole model).
    """
    if not heads:
        return
    if isinstance(engine, StreamedEngine):
        raise InvalidArgumentError("Expected the in-memory engine for --qk (a QK attribution needs the whole model "
                                   "loaded). Got the layer-streamed engine (--streamed, or a --max-memory budget).")
    n_heads = int(getattr(engine.config.get_text_config(), "num_attention_heads", 0))
    for layer, head in heads:
        if not (0 <= layer < engine.n_layers and 0 <= head < n_heads):
            raise InvalidArgumentError(f"Expected each --qk head among layers 0 to {engine.n_layers - 1} and heads 0 "
                                       f"to {n_heads - 1}. Got {layer}.{head}.")


def qk_phase(engine: Engine, token_ids: list[int], position: int, heads: tuple[tuple[int, int], ...]) -> list[Any]:
    """Each asked head's QK attribution at ``position`` (:func:`detjac.engine.qk_attribution`), in the order
    asked."""
    return [qk_attribution(engine, token_ids, layer, head, query=position) for layer, head in heads]


def component_key(name: str, pos: int, token_ids: list[int], layer: int) -> tuple[NodeKind, int, int, int]:
    """The node (kind, layer, index, position) that QK component ``name`` at ``pos`` is, for a head of ``layer``.

    Raises
    ------
    InvalidArgumentError
        A component name this mapping does not know (a neuron split of the MLPs: not asked for here).
    """
    if name == "E":
        return TOKEN, TOKEN_LAYER, int(token_ids[pos]), pos
    if name == "B":
        return CONSTANT, -1, -1, pos
    if name == "bias":
        return CONSTANT, layer, -1, pos
    found = _HEAD.match(name)
    if found:
        return HEAD, int(found[1]), int(found[2]), pos
    found = _NUMBERED.match(name)
    if found:
        return (MLP if found[1] == "M" else BIAS), int(found[2]), -1, pos
    raise InvalidArgumentError(f"Expected a QK component E, B, bias, A<l>.<h>, M<l> or B<l>. Got {name!r}.")


def record_of(qk: Any) -> dict[str, Any]:
    """What a QK attribution's record holds, with components still as node keys: the traced head's key
    (``node``), the most attended key position (``key``), its score, the strongest pairs and both sides'
    marginals (``(node key, value)``), every list as exact as the attribution."""
    top = max(qk.keys, key=lambda k: k["probability"])
    i, j, ids = qk.query_position, top["position"], qk.token_ids

    def key(name: str, pos: int) -> tuple[NodeKind, int, int, int]:
        return component_key(name, pos, ids, qk.layer)

    pairs = [(key(t["query"], i), key(t["key"], j), float(t["value"])) for t in top["terms"][:QK_PAIRS]]
    return {"node": (HEAD, qk.layer, qk.head, i), "key": j, "score": float(top["score"]),
            "probability": float(top["probability"]), "pairs": pairs,
            "q": [(key(s["component"], i), float(s["value"])) for s in top["query_sums"]],
            "k": [(key(s["component"], j), float(s["value"])) for s in top["key_sums"]]}
