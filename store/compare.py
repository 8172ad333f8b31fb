"""Two stores of the same run compared within rounding: :func:`compare_stores`.

Stores computed in different processes, thread counts, GEMM code paths or engines hold the same numbers to rounding,
never bit for bit (no BLAS promises the same bits across them). They must agree exactly on the prompt ids (none
twice, none missing), the run description, the attributes, the token ids, every array's shape and dtype; every float
array within :data:`ROUNDING` of its largest entry, and the measured errors within it absolutely. Timestamps are not
compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TIMESTAMPS = frozenset({"written_at", "created", "integrity"})  # the seal covers written_at

# Largest difference, relative to an array's largest entry, that rounding alone explains when the same numbers are
# computed with another thread count, worker process, GEMM code path or engine; keyed by the array's dtype.
ROUNDING = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}
# Attributes that hold measured errors: their values round with the arrays, so they are held to ROUNDING absolutely
# (they are relative errors themselves), not compared digit for digit.
MEASURED = frozenset({"reconstruction_error", "lens"})


@dataclass
class StoreComparison:
    """What :func:`compare_stores` found: ``differences`` (empty: the stores are equivalent), how many float arrays
    it compared, which of them differ in their bits (``differing``; none: the same bits) and the largest difference
    relative to an array's scale."""

    differences: list[str] = field(default_factory=list)
    float_arrays: int = 0
    differing: list[str] = field(default_factory=list)
    largest_relative: float = 0.0

    @property
    def equivalent(self) -> bool:
        return not self.differences

    @property
    def differing_bits(self) -> int:
        return len(self.differing)


def compare_stores(a: str | Path, b: str | Path) -> StoreComparison:
    """Compare the stores at ``a`` and ``b`` (see the module docstring); every difference is listed, as
    ``where: what``."""
    from .backend.zarr_store import open_store

    sa, sb = open_store(a), open_store(b)
    seen = StoreComparison()
    ids_a, ids_b = sa.prompt_ids(), sb.prompt_ids()
    for name, ids in (("first", ids_a), ("second", ids_b)):
        if len(ids) != len(set(ids)):
            seen.differences.append(f"the {name} store holds a prompt id twice")
    if set(ids_a) != set(ids_b):
        seen.differences.append(f"prompts in one store only: {sorted(set(ids_a) ^ set(ids_b))}")
    if sa.run != sb.run:
        seen.differences.append("the run descriptions differ")
    for pid in sorted(set(ids_a) & set(ids_b)):
        pa, pb = sa.get(pid), sb.get(pid)
        tolerance = ROUNDING.get(np.dtype(str(pa.attrs.get("storage_dtype", "float64"))), 1e-12)
        attrs = ({k: v for k, v in q.attrs.items() if k not in TIMESTAMPS} for q in (pa, pb))
        _compare_attrs(*attrs, tolerance, pid, seen.differences)
        arrays_a, arrays_b = _arrays(pa.path), _arrays(pb.path)
        if sorted(arrays_a) != sorted(arrays_b):
            seen.differences.append(f"{pid}: arrays in one only: {sorted(set(arrays_a) ^ set(arrays_b))}")
        for name in sorted(set(arrays_a) & set(arrays_b)):
            _compare_array(arrays_a[name], arrays_b[name], f"{pid}/{name}", seen)
    return seen


def _arrays(folder: Path) -> dict[str, np.ndarray]:
    """Every array of a prompt group, by its path inside the group (layerwise targets and triplets included)."""
    import zarr

    group = zarr.open_group(str(folder), mode="r")
    return {name: np.asarray(member[...]) for name, member in group.members(max_depth=None)
            if isinstance(member, zarr.Array)}


def _compare_array(x: np.ndarray, y: np.ndarray, where: str, seen: StoreComparison) -> None:
    if (x.dtype, x.shape) != (y.dtype, y.shape):
        seen.differences.append(f"{where}: {x.dtype}{x.shape} against {y.dtype}{y.shape}")
        return
    if x.dtype.kind != "f":  # token ids, token text, counts: exactly
        if not np.array_equal(x, y):
            seen.differences.append(f"{where}: differs")
        return
    seen.float_arrays += 1
    if x.tobytes() != y.tobytes():
        seen.differing.append(where)
    scale = float(np.abs(x).max()) if x.size else 0.0
    difference = float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max()) if x.size else 0.0
    relative = difference / scale if scale > 0 else difference
    seen.largest_relative = max(seen.largest_relative, relative)
    if not relative <= ROUNDING.get(x.dtype, 1e-2):  # a NaN differs too
        seen.differences.append(f"{where}: differs by {relative:.2e} of its scale")


def _compare_attrs(a: Any, b: Any, tolerance: float, where: str, out: list[str], measured: bool = False) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            out.append(f"{where}: keys {sorted(set(a) ^ set(b))} in one only")
        for key in sorted(set(a) & set(b), key=str):
            _compare_attrs(a[key], b[key], tolerance, f"{where}/{key}", out, measured or key in MEASURED)
    elif isinstance(a, float) and isinstance(b, float):  # measured errors absolutely, others relative to their size
        if not abs(a - b) <= (tolerance if measured else tolerance * max(abs(a), abs(b))):
            out.append(f"{where}: {a!r} against {b!r}")
    elif not (type(a) is type(b) and a == b):
        out.append(f"{where}: {a!r} against {b!r}")
