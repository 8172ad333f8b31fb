"""A gated MLP's frozen map folded into one d × d matrix per position, where that costs fewer FLOPs.

With its gate frozen, a gated MLP at position ``p`` is the linear map ``F_p = W_a diag(g_p) W_b`` (d × d; pulled back
``W_a = W_down``, ``W_b = W_up``, pushed forward their transposes). A block of ``B`` vectors crosses it as two GEMMs
through the intermediate of width ``f``: ``4 B d f`` FLOPs per position. Folded, ``F_p`` costs ``2 d² f`` once per
position and the block ``2 B d²``: fewer FLOPs when ``B > d f / (2 f - d)`` (for SmolLM2, d 576, f 1536: 355 rows of
576, so only where one block carries most of the d rows of a short prompt). :func:`fold_pays` prices both per layer
(its shapes) and per block (its rows); :class:`~detjac.engine.cost.CostModel` asks it too.

Scope of exactness: the same products summed in another order, so the result differs from the unfolded path by
rounding only (about 1e-16 relative in float64). A mixture of experts never folds: its experts are crossed by their own
piece (:class:`~detjac.engine.pieces.experts.Moe`), each on the few positions routed to it. Details: docs/engine.md,
"Folded MLPs"."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from detjac.errors import InvalidArgumentError

FOLD_MODES = ("auto", "always", "never")
_mode = ["auto"]  # the policy in force (folding() sets it for a block of code)
FOLD_CHUNK_BYTES = 32 * 2**20  # the scaled W_a of a few positions at once (their folds are one GEMM)


def mlp_flops(d: int, f: int, rows: int, folded: bool) -> int:
    """FLOPs of ``rows`` vectors crossing a gated MLP (d, f) at one position, folded or through its intermediate."""
    return 2 * d * d * f + 2 * rows * d * d if folded else 4 * rows * d * f


def fold_pays(d: int, f: int, rows: int) -> bool:
    """Whether ``rows`` vectors cross a gated MLP (d, f) faster folded (fewer FLOPs), unless :func:`folding` forces
    either way."""
    if _mode[0] != "auto":
        return _mode[0] == "always"
    return mlp_flops(d, f, rows, True) < mlp_flops(d, f, rows, False)


def fold_bytes(d: int, f: int, rows: int, n: int, itemsize: int) -> int:
    """Scratch bytes of :func:`plus_folded` beside a block of ``rows`` vectors over ``n`` positions: a few
    positions' scaled ``W_a``, their folds and their products."""
    k = min(n, max(1, FOLD_CHUNK_BYTES // (d * f * itemsize)))
    return k * (d * f + d * d + rows * d) * itemsize


@contextmanager
def folding(mode: str) -> Iterator[None]:
    """Fold gated MLPs ``always``, ``never`` or where it pays (``auto``, the default) inside the block (tests and
    benchmarks compare the paths; the result is the same either way up to rounding).

    Raises
    ------
    InvalidArgumentError
        Another mode.
    """
    if mode not in FOLD_MODES:
        raise InvalidArgumentError(f"Expected a fold mode among {', '.join(FOLD_MODES)}. Got {mode!r}.")
    before, _mode[0] = _mode[0], mode
    try:
        yield
    finally:
        _mode[0] = before


def plus_folded(acc: torch.Tensor, rows: Any, rhs: torch.Tensor) -> torch.Tensor:
    """``acc`` (B, m, d) plus, at each position ``p``, ``x[:, p] @ (W_a diag(g_p) W_b)`` where ``rows`` is the
    :class:`~detjac.engine.pieces.layer.GatedRows` of ``x`` (B, m, d), ``W_a`` (d, f), ``g`` (m, f) and ``rhs`` is
    ``W_b`` (f, d); a new tensor (``x`` may be ``acc`` itself). Positions go a few at a time (at most
    :data:`FOLD_CHUNK_BYTES` of scaled ``W_a``), their folds as one GEMM and the block's products as one batched
    GEMM."""
    x, weight, gate = rows.x, rows.weight, rows.gate
    b, m, d = x.shape
    f = weight.shape[1]
    k = max(1, FOLD_CHUNK_BYTES // (d * f * x.element_size()))  # positions per chunk
    out = acc.clone()
    for p0 in range(0, m, k):
        p1 = min(m, p0 + k)
        scaled = weight[None] * gate[p0:p1, None, :]  # (c, d, f): W_a diag(g_p)
        folded = torch.mm(scaled.reshape(-1, f), rhs).view(p1 - p0, d, -1)  # (c, d, d): F_p
        out[:, p0:p1] += torch.bmm(x[:, p0:p1].transpose(0, 1), folded).transpose(0, 1)
    return out
