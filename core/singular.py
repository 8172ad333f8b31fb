"""How a singular pair is oriented: one rule for the engine (torch) and the analyses (numpy).

Singular vectors are defined up to a joint sign of each pair ``(u_i, v_i)``. detjac flips each
pair so that ``u_i . r >= 0`` for a reference ``r`` in the output space, normally what the
operator produced from the prompt (``J x``, the output less an affine offset): the leading
left vectors then point the way the model's output does, and decoded tokens are comparable
across runs, engines and stores.
"""

from __future__ import annotations

from typing import Any


def orient(U: Any, V: Any, reference: Any) -> tuple[Any, Any]:
    """Flip the pairs of ``U`` (d_out, k) and ``V`` (d_in, k) so that ``reference @ U >= 0`` column by column.

    Works on torch tensors and numpy arrays alike (``reference`` (d_out,) of the same kind).
    """
    ref = reference.to(U.dtype) if hasattr(reference, "to") else reference.astype(U.dtype)
    sign = 1 - 2 * ((ref @ U) < 0)  # (k,) +1 or -1
    return U * sign, V * sign
