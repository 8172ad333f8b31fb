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

PIECES_BOUND = {"float64": FLOAT64_EXACTNESS_BOUND, "float32": 1e-3}
"""Largest relative error with which the engine's explicit pieces of a layer or model may rebuild what the model
computes (below float32: :data:`PIECES_BOUND_LOW`). Loose on purpose: it catches a wrong wiring or an unfolded
factor, whose errors are of order one; exactness itself is what the tests prove."""

PIECES_BOUND_LOW = 5e-2


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


def pieces_bound(dtype: Any) -> float:
    """:data:`PIECES_BOUND` of ``dtype`` (a name such as ``"float64"``, or a torch dtype)."""
    return PIECES_BOUND.get(str(dtype).removeprefix("torch."), PIECES_BOUND_LOW)


def check_exact(error: float, dtype: Any, *, detached: bool = True, where: str = "", what: str = "",
                family: str | None = None) -> None:
    """Refuse a detached float64 reconstruction ``error`` at or above :data:`FLOAT64_EXACTNESS_BOUND` (NaN included):
    a nonlinearity escaped the detach rules. Other dtypes only round, and an ordinary Jacobian (``detached`` False) is
    not exact, so neither is checked. The one wording of that refusal: ``where`` opens it (``"Prompt on line 3: "``),
    ``what`` names a target other than the output, ``family`` the rules that let the nonlinearity through.

    Raises
    ------
    LinearizationError
        ``"{where}float64 reconstruction error{ of what} {error} is above 1e-09; a nonlinearity escaped detaching."``
        (``the {family} detach rules`` for ``detaching`` when ``family`` is given).
    """
    if not detached or str(dtype).removeprefix("torch.") != "float64" or error < FLOAT64_EXACTNESS_BOUND:
        return
    from .errors import LinearizationError

    of = f" of {what}" if what else ""
    rules = f"the {family} detach rules" if family else "detaching"
    raise LinearizationError(f"{where}float64 reconstruction error{of} {error:.3e} is above "
                             f"{FLOAT64_EXACTNESS_BOUND:.0e}; a nonlinearity escaped {rules}.")


def _norm(x: Any) -> float:
    if hasattr(x, "detach"):  # a torch tensor: its own 2-norm, on its own device (no torch import here)
        return float(x.norm())
    import numpy as np

    return float(np.linalg.norm(np.asarray(x).ravel()))
