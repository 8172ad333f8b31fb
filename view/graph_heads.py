"""Attention heads on the graph page: a link's head loadings, checked, and the heads ranked by the top logit's graph.

A loaded link of the graph JSON (``detjac graph ... --heads N``; docs/graphs.md, "Head loadings") carries
``"head_loadings": {"<layer>": {"<head>": w, ..., "skip": w}}``: for every attention layer the link can cross, the
part of its weight that travels through each head of that layer, and ``skip``, the part that bypasses the layer's
attention; each layer's loadings and skip sum to the link's weight. :func:`parse_loadings` checks that (a file whose
layers do not sum is refused, never drawn) and :func:`compact_loadings` keeps what a clicked link shows.

The **heads panel** (:data:`HEADS_MEANING`) ranks heads by how much of the top logit's graph they carry. Let ``t`` be
the graph's most probable logit, ``F[u]`` the driver share of node ``u`` for ``t`` (:mod:`~detjac.view.graph_drivers`;
``F[t] = 1``) and ``A[u, s] = |W[u, s]| / sum_s' |W[u, s']|``. The link ``s -> u`` carries the **flow**
``phi = F[u] * A[u, s]`` of ``t``: the share of ``t``'s incoming |weight| that passes along it (over the links into
``t`` the flows sum to 1, and over any set of links every path to ``t`` crosses once). Head ``(l, h)`` carries

    C[l, h] = sum over loaded links crossing layer l of  phi(link) * w_{l,h}(link) / W(link),

its signed share of each loaded link's weight, weighted by that link's flow; a layer's heads and skip sum to the flow
of the loaded links that cross it (``covered``). ``direct[l, h]`` is the plain sum of ``w_{l,h}`` over the loaded links
into ``t``, in the logit's units. Both are exact from the loadings in the file; links without loadings count for
nothing (the panel says how many are loaded).

The panel also lists **every head's direct effect** (:data:`HEAD_EFFECTS_MEANING`) on each logit target, as the graph
JSON carries it (``metadata.info.head_effects``; :mod:`detjac.graphs.head_effects`): :func:`head_effect_rows` checks
it (a damaged or foreign one is refused, never drawn) and orders the heads by ``|direct effect|`` on the first target.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..numerals import parse_index
from .graph_drivers import driver_shares
from .jsonable import finite_number

HEADS_SHOWN = 4  # heads listed per crossed layer of a clicked link (the rest summed, so each layer still sums)
HEADS_RANKED = 40  # rows of the heads panel
MAX_INDEX = 1_000_000  # layers and heads: far more than any model has
SUM_TOLERANCE = 1e-5  # a layer's loadings and skip against the link's weight, relative to their magnitudes
SKIP = "skip"
HEADS_MEANING = (
    "Heads ranked by how much of the top logit's graph they carry. Each link carries a flow of the top logit: the "
    "share of the logit's incoming |weight| that passes along it (its driver share times the link's share of its "
    "target's incoming |weight|). A head's carried share is the sum, over the loaded links that can cross its layer, "
    "of the link's flow times the head's signed share of the link's weight (its loading divided by the weight); a "
    "layer's heads and skip sum to the flow of the loaded links crossing it (covered). Direct: the sum of the head's "
    "loadings over the loaded links into the top logit, in the logit's units. Links without loadings count for "
    "nothing: only the links `detjac graph --heads N` loaded are covered.")

HEAD_EFFECTS_MEANING = (
    "Direct effect: the head's output at the predicted position (W_O,h P_h V_h x, through any frozen norm between "
    "the attention and the residual stream, its constant biases left to the bias nodes), dotted with the gradient of "
    "the target's logit with respect to the residual stream leaving the last layer (the final norm's scale frozen); "
    "over every head and every MLP output, plus the embedding's stream and the constants at that position, these "
    "sum exactly to the logit's value.")


def _index(text: Any, what: str, where: str) -> int:
    index = parse_index(text, below=MAX_INDEX)
    if index is None:
        raise InvalidArgumentError(f"Expected head loadings keyed by a {what} number in {where}. "
                                   f"Got {str(text)[:40]!r}.")
    return index


def parse_loadings(raw: Any, weight: float, where: str, crossed: range | None = None,
                   n_heads: int | None = None) -> list[dict[str, Any]]:
    """A link's ``head_loadings``, checked: ``[{"layer": l, "heads": [[h, w], ...] (largest |w| first), "skip": w},
    ...]`` by layer.

    Parameters
    ----------
    raw : Any
        The link's ``head_loadings`` as read.
    weight : float
        The link's weight.
    where : str
        The link and its file, for messages.
    crossed : range, optional
        The layers the link crosses (:func:`detjac.graph_settings.crossed_layers`): the loadings must be on those
        layers and no other. None: not checked (the model's layer count unknown).
    n_heads : int, optional
        The model's heads per layer: each layer must list heads 0 to ``n_heads - 1``. None: as many as the link's
        first layer lists, in every layer.

    Raises
    ------
    InvalidArgumentError
        Not an object of layers, each an object of heads and ``skip`` with finite numbers; a layer whose loadings
        and skip do not sum to ``weight`` (within :data:`SUM_TOLERANCE` of their magnitudes); loadings on a layer the
        link does not cross, or missing on one it crosses; a layer without every head of the model, or with one
        it lacks.
    """
    if not isinstance(raw, dict):  # empty: a link that crosses no attention layer (a last-layer neuron to a logit)
        raise InvalidArgumentError(f"Expected head_loadings to be an object of layers in {where}. "
                                   f"Got {str(raw)[:100]}.")
    layers = []
    for layer_key, per in raw.items():
        layer = _index(layer_key, "layer", where)
        if not isinstance(per, dict) or SKIP not in per or len(per) < 2 or not all(map(finite_number, per.values())):
            raise InvalidArgumentError(f"Expected layer {layer} of the head loadings in {where} to be an object of "
                                       f"heads and 'skip', each a finite number. Got {str(per)[:100]}.")
        heads = sorted(([_index(k, "head", where), float(v)] for k, v in per.items() if k != SKIP),
                       key=lambda hw: (-abs(hw[1]), hw[0]))
        total = sum(w for _, w in heads) + float(per[SKIP])
        scale = abs(weight) + sum(abs(w) for _, w in heads) + abs(float(per[SKIP]))
        if abs(total - weight) > SUM_TOLERANCE * scale:
            raise InvalidArgumentError(f"Expected each layer's head loadings and skip to sum to the link's weight in "
                                       f"{where}. Got layer {layer} summing to {total:.6g} for a weight of "
                                       f"{weight:.6g}: the file is damaged or was edited.")
        layers.append({"layer": layer, "heads": heads, "skip": float(per[SKIP])})
    layers.sort(key=lambda x: x["layer"])
    _check_complete(layers, crossed, n_heads, where)
    return layers


def _check_complete(layers: list[dict[str, Any]], crossed: range | None, n_heads: int | None, where: str) -> None:
    """Refuse loadings on other layers than ``crossed`` or other heads than ``0 .. n_heads - 1`` (see
    :func:`parse_loadings`): a link's loadings are split over every head of every layer it crosses, so a layer or a
    head missing or added would draw another split than the model's."""
    found = [x["layer"] for x in layers]
    if crossed is not None and found != list(crossed):
        span = f"layers {crossed.start} to {crossed.stop - 1}" if crossed else "no layer"
        raise InvalidArgumentError(f"Expected head loadings on the layers the link crosses ({span}) in {where}. Got "
                                   f"{'layers ' + str(found)[1:-1][:80] if found else 'none'}: the file is damaged "
                                   f"or was edited.")
    for x in layers:
        heads = sorted(h for h, _ in x["heads"])
        want = n_heads if n_heads is not None else len(layers[0]["heads"])
        if heads != list(range(want)):
            raise InvalidArgumentError(f"Expected the loadings of each head of the model (0 to {want - 1}) at "
                                       f"every layer in {where}. Got heads {str(heads)[1:-1][:80]} at layer "
                                       f"{x['layer']}: the file is damaged or was edited.")


def compact_loadings(layers: list[dict[str, Any]], shown: int = HEADS_SHOWN) -> list[dict[str, Any]]:
    """What a clicked link shows per crossed layer: ``top`` (its ``shown`` heads of largest |w|, ``[[h, w], ...]``),
    ``rest`` (the other heads' sum) and ``n_rest`` (how many), ``skip``: still summing to the link's weight."""
    return [{"layer": x["layer"], "top": x["heads"][:shown], "rest": sum(w for _, w in x["heads"][shown:]),
             "n_rest": max(0, len(x["heads"]) - shown), "skip": x["skip"]} for x in layers]


def head_ranking(nodes: list[dict[str, Any]], links: list[dict[str, Any]],
                 loadings: list[list[dict[str, Any]] | None], ranked: int = HEADS_RANKED) -> dict[str, Any]:
    """The heads panel (module docstring): ``logit`` (the top logit's id, None without logits), ``loaded`` (links
    with loadings), ``links`` (all links), ``into_logit`` / ``loaded_into_logit`` (links into the top logit, and
    of those the loaded), ``rows`` (``layer``, ``head``, ``flow`` (C), ``direct``; the ``ranked`` largest |flow|,
    then |direct|), ``layers`` (``layer``, ``covered``, ``skip``: the skip's flow), ``meaning``.

    Parameters
    ----------
    nodes, links : list of dict
        The page's nodes and links (:func:`~detjac.view.graph_page.graph_payload`).
    loadings : list
        Per link, :func:`parse_loadings` of its loadings, or None.
    """
    loaded = [i for i, x in enumerate(loadings) if x is not None]
    logits = [i for i, n in enumerate(nodes) if n["type"] == "logit"]
    out: dict[str, Any] = {"logit": None, "loaded": len(loaded), "links": len(links), "into_logit": 0,
                           "loaded_into_logit": 0, "rows": [], "layers": [], "meaning": HEADS_MEANING}
    if not logits:
        return out
    top = max(logits, key=lambda i: (nodes[i]["p"] if nodes[i]["p"] is not None else -1.0, -i))
    out["logit"] = nodes[top]["id"]
    index = {n["id"]: i for i, n in enumerate(nodes)}
    sources = np.asarray([index[x["source"]] for x in links], dtype=np.int64)
    targets = np.asarray([index[x["target"]] for x in links], dtype=np.int64)
    weights = np.asarray([x["weight"] for x in links], dtype=np.float64)
    out["into_logit"] = int((targets == top).sum())
    out["loaded_into_logit"] = sum(1 for i in loaded if targets[i] == top)
    if not loaded:
        return out
    flow_to = driver_shares(len(nodes), sources, targets, weights, np.asarray([top]))[0]
    flow_to[top] = 1.0
    incoming = np.bincount(targets, weights=np.abs(weights), minlength=len(nodes))
    carried: dict[tuple[int, int], float] = {}
    direct: dict[tuple[int, int], float] = {}
    covered: dict[int, list[float]] = {}
    for i in loaded:
        t, w = targets[i], weights[i]
        phi = flow_to[t] * abs(w) / incoming[t] if incoming[t] > 0 else 0.0
        for layer in loadings[i] or []:
            row = covered.setdefault(layer["layer"], [0.0, 0.0])
            row[0] += phi
            row[1] += phi * layer["skip"] / w if w != 0 else 0.0
            for head, load in layer["heads"]:
                key = (layer["layer"], head)
                carried[key] = carried.get(key, 0.0) + (phi * load / w if w != 0 else 0.0)
                if t == top:
                    direct[key] = direct.get(key, 0.0) + load
    order = sorted(carried, key=lambda k: (-abs(carried[k]), -abs(direct.get(k, 0.0)), k))[:ranked]
    out["rows"] = [{"layer": layer, "head": head, "flow": carried[(layer, head)],
                    "direct": direct.get((layer, head), 0.0)} for layer, head in order]
    out["layers"] = [{"layer": layer, "covered": c, "skip": s} for layer, (c, s) in sorted(covered.items())]
    return out


def head_effect_rows(info: dict[str, Any], nodes: list[dict[str, Any]], n_layers: int | None, n_heads: int | None,
                     where: str) -> dict[str, Any] | None:
    """Every head's direct effect on the graph's logits (module docstring), checked: ``targets`` (the logit node ids,
    in the file's order), ``rows`` (``layer``, ``head``, ``effects``: one per target; every head of the model,
    largest ``|effect|`` on the first target first), ``meaning``; None for a graph without them.

    Raises
    ------
    InvalidArgumentError
        ``head_effects`` that is not ``{"targets": [logit node ids of the graph], "values": K x layers x heads finite
        numbers}``, or whose layers or heads are not the model's (``n_layers``, ``n_heads`` where known).
    """
    raw = info.get("head_effects")
    if raw is None:
        return None
    logits = {n["id"] for n in nodes if n["type"] == "logit"}
    targets = raw.get("targets") if isinstance(raw, dict) else None
    values = raw.get("values") if isinstance(raw, dict) else None
    if not isinstance(targets, list) or not targets or not all(t in logits for t in targets) or \
            not isinstance(values, list) or len(values) != len(targets):
        raise InvalidArgumentError(f"Expected metadata.info.head_effects in {where} to be an object with 'targets' "
                                   f"(logit node ids of the graph) and 'values' (one per target). Got "
                                   f"{str(raw)[:120]}: the file is damaged or was edited.")
    try:  # a ragged list is refused by numpy; a bool or a string by the check of every number
        array = np.asarray(values, dtype=np.float64) if all(map(finite_number, _numbers(values))) else np.zeros(0)
    except (TypeError, ValueError):
        array = np.zeros(0)
    first = values[0] if isinstance(values[0], list) else []
    want = (len(targets), n_layers or len(first), n_heads or (len(first[0]) if first and isinstance(first[0], list)
                                                            else 0))
    if array.shape != want or not want[2]:
        raise InvalidArgumentError(f"Expected metadata.info.head_effects' values in {where} as {want[0]} x "
                                   f"{want[1]} layers x {want[2]} heads finite numbers. Got "
                                   f"{'shape ' + str(array.shape) if array.size else str(values)[:80]}: the file "
                                   f"is damaged or was edited.")
    order = sorted(np.ndindex(*array.shape[1:]), key=lambda lh: (-abs(array[0][lh]), lh))
    rows = [{"layer": int(layer), "head": int(head), "effects": array[:, layer, head].tolist()}
            for layer, head in order]
    return {"targets": list(targets), "rows": rows, "meaning": HEAD_EFFECTS_MEANING}


def _numbers(nested: Any) -> list[Any]:
    """The leaves of nested lists."""
    return [v for x in nested for v in _numbers(x)] if isinstance(nested, list) else [nested]
