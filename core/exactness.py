"""What "exact" means: the relative reconstruction error and the bounds it is held to.

A detached Jacobian reconstructs its target, ``y = sum_k J_k x_k (+ b)``: in float64 to ~1e-15 for every family, and
above :data:`FLOAT64_EXACTNESS_BOUND` a nonlinearity escaped the detach rules, so it is refused. Lower precisions
only round, and get looser bounds (:data:`DTYPE_BOUND`)."""

from __future__ import annotations

from typing import Any

FLOAT64_EXACTNESS_BOUND = 1e-9
"""Largest relative reconstruction error a detached float64 Jacobian may have."""

DTYPE_BOUND = {"float64": FLOAT64_EXACTNESS_BOUND, "float32": 1e-3, "float16": 5e-2, "bfloat16": 2e-1}
"""Largest relative reconstruction error accepted for a stored prompt computed in each dtype."""


def relative_error(approx: Any, exact: Any) -> float:
    """``||approx - exact|| / ||exact||`` (the absolute error when ``exact`` is zero).

    Takes torch tensors (any device) or numpy arrays; the norms are computed in the input's
    precision, without overflow for large entries.
    """
    err, ref = _norm(approx - exact), _norm(exact)
    return err / ref if ref > 0 else err


def is_exact(error: float, dtype: str) -> bool:
    """Whether a detached Jacobian's reconstruction ``error`` is within the bound for ``dtype`` (a name such as
    ``"float64"``); NaN is never exact."""
    return error < DTYPE_BOUND.get(dtype, FLOAT64_EXACTNESS_BOUND)


def _norm(x: Any) -> float:
    if hasattr(x, "detach"):  # a torch tensor: its own 2-norm, on its own device (no torch import here)
        return float(x.norm())
    import numpy as np

    return float(np.linalg.norm(np.asarray(x).ravel()))
