"""A QK attribution's sums, torch-free: each side's marginals, the contrast of two keys, and a listing's remainder.

A key's pre-softmax score is the sum of its terms ``(Q, K, v)``, one per pair of components (query side ``Q`` at the
query position, key side ``K`` at the key position: :mod:`detjac.engine.tools.qk`). Summed over the key side, the
terms give each query-side component's **marginal**; summed over the query side, each key-side one's; each list adds
up to the score. For two keys ``j`` and ``j'`` of the same query the score is linear in each side, so the difference
``s_j - s_j'`` splits exactly per query-side component (its marginal at ``j`` minus its marginal at ``j'``) and per
key-side component (the same, a component missing at one key counting 0): the **contrast**. Each of these lists adds
up to what it splits up to float64 rounding; nothing here approximates.

Lists of ``(name, value)`` pairs come largest ``|value|`` first (ties by name), so what is listed first is what
matters most, and :func:`listed` gives the rows shown with the remainder that keeps a table summing to its total.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from .errors import InvalidArgumentError

__all__ = ["attended_key", "contrast_keys", "contrast_sums", "listed", "ranked", "side_sums"]

Pair = tuple[str, float]


def ranked(values: Mapping[str, float]) -> list[Pair]:
    """``values`` as ``(name, value)`` pairs, largest ``|value|`` first (ties by name)."""
    return sorted(values.items(), key=lambda nv: (-abs(nv[1]), nv[0]))


def side_sums(terms: Iterable[tuple[str, str, float]]) -> tuple[list[Pair], list[Pair]]:
    """Each query-side component's sum over the key side, and each key-side component's over the query side, from
    a key's terms ``(Q, K, v)``; each list (:func:`ranked`) adds up to the terms' total. Sums are ``math.fsum``'d."""
    query: dict[str, list[float]] = {}
    key: dict[str, list[float]] = {}
    for q, k, v in terms:
        query.setdefault(q, []).append(v)
        key.setdefault(k, []).append(v)
    return (ranked({n: math.fsum(vs) for n, vs in query.items()}),
            ranked({n: math.fsum(vs) for n, vs in key.items()}))


def contrast_sums(sums: Iterable[Pair], other: Iterable[Pair]) -> list[Pair]:
    """Per component, its value in ``sums`` minus its value in ``other`` (0 where a list lacks it), :func:`ranked`:
    one side's split of the difference of the two totals."""
    out = dict(sums)
    for name, value in other:
        out[name] = out.get(name, 0.0) - value
    return ranked(out)


def attended_key(probabilities: Mapping[int, float], key: int | None = None) -> int:
    """``key`` checked to be a key position of ``probabilities`` (position -> attention weight), or the most
    attended one (ties: the earlier position).

    Raises
    ------
    InvalidArgumentError
        ``key`` is not a key position the query attends to.
    """
    return _pick(probabilities, key, "key", ())


def contrast_keys(probabilities: Mapping[int, float], key: int | None = None,
                  other: int | None = None) -> tuple[int, int]:
    """The two keys a contrast compares: :func:`attended_key` and ``other`` (default the most attended of the rest:
    the next-most-attended when ``key`` is the most attended).

    Raises
    ------
    InvalidArgumentError
        Fewer than two keys, a position that is not a key, or ``other`` equal to ``key``.
    """
    if len(probabilities) < 2:
        raise InvalidArgumentError(f"Expected at least two key positions to contrast. Got {len(probabilities)}: "
                                   f"the query attends to position {next(iter(probabilities), None)} only.")
    key = attended_key(probabilities, key)
    if other == key:
        raise InvalidArgumentError(f"Expected two different key positions to contrast. Got {key} twice.")
    return key, _pick(probabilities, other, "other key", (key,))


def _pick(probabilities: Mapping[int, float], chosen: int | None, name: str, besides: Iterable[int]) -> int:
    keys = sorted(probabilities)
    if chosen is None:
        among = [j for j in keys if j not in set(besides)]
        return max(among, key=lambda j: (probabilities[j], -j))
    if chosen not in probabilities:
        raise InvalidArgumentError(f"Expected the {name} to be a key position the query attends to "
                                   f"({keys[0]} to {keys[-1]}, as the mask allows). Got {chosen}.")
    return chosen


def listed(rows: list[Pair], top: int) -> tuple[list[Pair], int, float]:
    """The first ``top`` rows, how many others there are, and the others' sum (``math.fsum``): the rows shown and
    the remainder row that keeps the table adding up to its total."""
    rest = rows[top:]
    return list(rows[:top]), len(rest), math.fsum(v for _, v in rest)
