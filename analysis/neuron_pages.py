"""Neuron pages from a neuron index (``detjac neurons``): what a graph node's label (``clerp``) and the viewer's
neuron page say about an MLP neuron, read from the index alone (no model).

A page holds the neuron's top contexts of each sign (the token, with a few tokens before and after it), its
histogram, the share of positions where it is positive, its mean and spread, and its write vector's logit effects.
A ``clerp`` is a short plain summary of one side of the neuron: the most frequent tokens at its top contexts of that
sign, then the tokens its write vector moves most that way. A neuron is labelled by the side it fires on in the graph's
prompt: a positive activation by its positive contexts and the tokens its write vector raises (``top ' Paris' ×5 ·
writes ' city'``), a negative one by its negative contexts and the tokens its write vector lowers, the sign stated
first (``− top ' France' ×3 · lowers ' French'``; a negative activation times the write vector raises those tokens).
Nothing is interpreted: both are counts and top tokens."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np

from detjac.errors import InvalidArgumentError

if TYPE_CHECKING:
    from detjac.store import NeuronIndex

CLERP_TOKENS = 3  # tokens named in a clerp, each part
CONTEXT = 6  # tokens shown before a top context's token (and half as many after)


def check_neuron(index: NeuronIndex, layer: Any, neuron: Any) -> tuple[int, int]:
    """``(layer, neuron)`` as ints inside the index (InvalidArgumentError otherwise, naming the ranges)."""
    layers, per_layer = index.shape
    ok = all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in (layer, neuron))
    if not ok or not 0 <= int(layer) < layers or not 0 <= int(neuron) < per_layer:
        raise InvalidArgumentError(f"Expected a layer in 0..{layers - 1} and a neuron in 0..{per_layer - 1}. Got "
                                   f"layer {layer!r}, neuron {neuron!r}.")
    return int(layer), int(neuron)


def _tokens_at(index: NeuronIndex, layer: int, neuron: int, sign: int) -> list[str]:
    a = index.arrays
    prompts, positions = a["top_prompt"][layer, neuron, sign], a["top_position"][layer, neuron, sign]
    ids = [int(index.prompt_tokens(int(p))[int(q)]) for p, q in zip(prompts, positions, strict=True) if p >= 0]
    return index.token_text(ids) if ids else []


# per side (the index's sign axis: 0 positive, 1 negative): the label's lead, its write part, its empty label
SIDES = (("", "writes", "no positive context in the corpus"), ("− ", "lowers", "− no negative context in the corpus"))


def side_of(activation: float | None) -> int:
    """The index's sign axis a neuron is labelled by: 1 (negative) for a negative ``activation``, 0 otherwise (a
    positive or zero one, or none known)."""
    return 1 if activation is not None and activation < 0 else 0


def clerp(index: NeuronIndex, layer: int, neuron: int, activation: float | None = None) -> str:
    """The neuron's label from its contexts, on the side ``activation`` fires on (module docstring).

    Parameters
    ----------
    index : NeuronIndex
        The neuron index (``detjac neurons``).
    layer, neuron : int
        The neuron.
    activation : float, optional
        Its value where it is labelled (a graph node's activation). Negative: the label is its negative side's,
        ``− top ' France' ×3 · lowers ' French' ...``; otherwise (or None) its positive side's, ``top ' Paris' ×5,
        ' France' ×3 · writes ' city' ' town'`` (the most frequent tokens at its top contexts of that sign, with their
        counts, then its write vector's top tokens that way).

    Raises
    ------
    InvalidArgumentError
        ``layer`` or ``neuron`` outside the index.
    """
    layer, neuron = check_neuron(index, layer, neuron)
    sign = side_of(activation)
    lead, verb, empty = SIDES[sign]
    counts = Counter(_tokens_at(index, layer, neuron, sign)).most_common(CLERP_TOKENS)
    parts = []
    if counts:
        parts.append("top " + ", ".join(f"{t!r} ×{n}" for t, n in counts))
    writes = [int(i) for i in index.arrays["write_ids"][layer, neuron, sign][:CLERP_TOKENS] if i >= 0]
    if writes:
        parts.append(f"{verb} " + " ".join(repr(t) for t in index.token_text(writes)))
    return lead + " · ".join(parts) if parts else empty


def relabel(labels: list[str], neurons: np.ndarray, index: NeuronIndex,
            activations: np.ndarray | None = None) -> list[str]:
    """Each graph neuron's label (``neurons`` (M, 3): layer, index, position) replaced by its :func:`clerp`, on the
    side its value in ``activations`` (M,) fires on (its positive side for each, without them)."""
    rows = np.asarray(neurons)[:len(labels)]
    values = [None] * len(rows) if activations is None else [float(v) for v in np.asarray(activations)[:len(rows)]]
    return [clerp(index, int(layer), int(neuron), value)
            for (layer, neuron, _), value in zip(rows, values, strict=True)]


def quantiles(histogram: np.ndarray, edges: np.ndarray, qs: tuple[float, ...] = (0.01, 0.5, 0.99)) -> list[str]:
    """The bins holding the quantiles ``qs`` of a histogram over ``edges`` (``"(a, b]"``: the index keeps bins, not
    values)."""
    cum = np.cumsum(histogram)
    total = cum[-1] if cum.size else 0
    bounds = np.concatenate([[-np.inf], edges, [np.inf]])
    out = []
    for q in qs:
        b = int(np.searchsorted(cum, q * total, side="left")) if total else 0
        out.append(f"[{bounds[b]:.3g}, {bounds[b + 1]:.3g})")
    return out


def neuron_page(index: NeuronIndex, layer: int, neuron: int, context: int = CONTEXT) -> dict[str, Any]:
    """Everything the viewer's neuron page shows, as plain JSON values (texts are data: the page sets them as
    text). ``contexts.positive`` / ``negative``: ``{prompt, line, position, value, before, token, after}`` each,
    best first; ``clerp`` and ``clerp_negative``: its label on each side (:func:`clerp`), which the page leads with as
    the graph node it is opened from fires."""
    layer, neuron = check_neuron(index, layer, neuron)
    a = index.arrays
    n = int(index.attrs["n_tokens"])
    contexts: dict[str, list[dict[str, Any]]] = {}
    for sign, name in enumerate(("positive", "negative")):
        rows = []
        for p, q, v in zip(a["top_prompt"][layer, neuron, sign], a["top_position"][layer, neuron, sign],
                           a["top_value"][layer, neuron, sign], strict=True):
            if p < 0:
                continue
            ids = index.prompt_tokens(int(p))
            texts = index.token_text(ids)
            rows.append({"prompt": int(p), "line": int(a["prompt_line"][p]), "position": int(q), "value": float(v),
                         "before": texts[max(0, q - context):q], "token": texts[q],
                         "after": texts[q + 1:q + 1 + max(1, context // 2)]})
        contexts[name] = rows
    writes = {}
    for sign, name in enumerate(("raises", "lowers")):
        ids, values = a["write_ids"][layer, neuron, sign], a["write_values"][layer, neuron, sign]
        keep = ids >= 0
        writes[name] = [[t, float(v)] for t, v in zip(index.token_text(ids[keep]), values[keep], strict=True)]
    mean = float(a["sum"][layer, neuron]) / n if n else 0.0
    var = float(a["sum_squares"][layer, neuron]) / n - mean * mean if n else 0.0
    return {"layer": layer, "neuron": neuron, "tokens": n, "clerp": clerp(index, layer, neuron),
            "clerp_negative": clerp(index, layer, neuron, -1.0),
            "frequency": float(a["n_positive"][layer, neuron]) / n if n else 0.0,
            "negative_share": float(a["n_negative"][layer, neuron]) / n if n else 0.0,
            "mean": mean, "std": float(np.sqrt(max(var, 0.0))),
            "quantiles": dict(zip(("1%", "50%", "99%"), quantiles(a["histogram"][layer, neuron], a["edges"]),
                                  strict=True)),
            "histogram": {"edges": [float(e) for e in a["edges"]],
                          "counts": [int(c) for c in a["histogram"][layer, neuron]]},
            "contexts": contexts, "writes": writes,
            "model": {k: index.identity.get(k) for k in ("family", "model_type", "weights_sha256", "dtype")}}
