"""Helpers shared by the store tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from detjac.store import open_store

TIMESTAMPS = {"written_at", "created", "integrity"}  # the seal covers written_at

PROMPTS = [
    "Kitten, n. A young cat.",
    "Oak, n. (Bot.) Any tree of the genus Quercus.",
    "Bread, n. An article of food made from flour.",
    "Violin, n. (Mus.) A small stringed instrument.",
    "Copper, n. (Chem.) A common metal of a reddish color.",
    "Whale, n. (Zool.) Any aquatic mammal of the order Cetacea.",
    "Harp, n. (Mus.) A stringed instrument played with the fingers.",
    "Arrogance, n. The act or habit of making undue claims.",
]


def write_prompts(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_default(folder: Path, lines: list[str], name: str, *options: str) -> Any:
    """``detjac run default`` over ``lines`` into ``folder/name`` (with ``options``); the store, opened."""
    from click.testing import CliRunner

    from detjac.cli.main import main

    prompts = write_prompts(folder / f"{name}.txt", lines)
    result = CliRunner().invoke(main, ["run", "default", str(prompts), "--out", str(folder / name), *options])
    assert result.exit_code == 0, result.output
    return open_store(folder / name)


def store_snapshot(path: Path) -> dict:
    """Every array's bytes and every attribute except timestamps, per prompt id."""
    st = open_store(path)
    snap = {"run": st.run}
    for prompt in st:
        arrays = {name: prompt.array(name) for name in ("embeddings", "output", "token_ids")}
        if not prompt.without_jacobian:  # a --lens prompt keeps none
            arrays["jacobian"] = prompt.jacobian(lazy=False)
        attrs = {k: v for k, v in prompt.attrs.items() if k not in TIMESTAMPS}
        snap[prompt.id] = (attrs, {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in arrays.items()})
    return snap


def assert_same_store(a: Path, b: Path) -> None:
    """The same bits: for one command run twice with the same settings on the same machine (a resume after a kill, a
    rerun). Stores computed in other processes, thread counts or engines are compared by
    :func:`assert_equivalent_store`, since BLAS rounds differently there."""
    sa, sb = store_snapshot(a), store_snapshot(b)
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert sa[key] == sb[key], key


# Largest difference, relative to an array's largest entry, that rounding alone explains when the same numbers are
# computed with another thread count, worker process, GEMM code path or engine; keyed by the array's dtype.
ROUNDING = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}
# Attributes that hold measured errors: their values round with the arrays, so they are held to ROUNDING absolutely
# (they are relative errors themselves), not compared digit for digit.
MEASURED = {"reconstruction_error", "lens"}


@dataclass
class StoreComparison:
    """What :func:`assert_equivalent_store` saw: how many float arrays differed in their bits (0 means the two stores
    hold the same bits) and the largest difference relative to the array's scale."""

    float_arrays: int = 0
    differing_bits: int = 0
    largest_relative: float = 0.0
    differing: list[str] = field(default_factory=list)


def assert_equivalent_store(a: Path, b: Path) -> StoreComparison:
    """Two stores of the same run computed in different processes, thread counts or engines: the same prompt ids
    (no duplicate, none missing), run description, attributes, token ids, shapes and dtypes exactly; every float array
    and measured error within rounding (:data:`ROUNDING`), since no BLAS promises the same bits across thread counts
    or code paths."""
    sa, sb = open_store(a), open_store(b)
    ids_a, ids_b = sa.prompt_ids(), sb.prompt_ids()
    assert len(ids_a) == len(set(ids_a)) and len(ids_b) == len(set(ids_b)), "a prompt id appears twice"
    assert sorted(ids_a) == sorted(ids_b), f"prompts differ: {sorted(set(ids_a) ^ set(ids_b))}"
    assert sa.run == sb.run
    seen = StoreComparison()
    for pid in ids_a:
        pa, pb = sa.get(pid), sb.get(pid)
        tolerance = ROUNDING.get(np.dtype(str(pa.attrs.get("storage_dtype", "float64"))), 1e-12)
        _compare_attrs(*({k: v for k, v in q.attrs.items() if k not in TIMESTAMPS} for q in (pa, pb)), tolerance, pid)
        arrays_a, arrays_b = _arrays(pa.path), _arrays(pb.path)
        assert sorted(arrays_a) == sorted(arrays_b), pid
        for name, x in arrays_a.items():
            _compare_array(x, arrays_b[name], f"{pid}/{name}", seen)
    return seen


def _arrays(folder: Path) -> dict[str, np.ndarray]:
    """Every array of a prompt group, by its path inside the group (layerwise targets and triplets included)."""
    import zarr

    group = zarr.open_group(str(folder), mode="r")
    return {name: np.asarray(member[...]) for name, member in group.members(max_depth=None)
            if isinstance(member, zarr.Array)}


def _compare_array(x: np.ndarray, y: np.ndarray, where: str, seen: StoreComparison) -> None:
    assert (x.dtype, x.shape) == (y.dtype, y.shape), f"{where}: {x.dtype}{x.shape} against {y.dtype}{y.shape}"
    if x.dtype.kind != "f":  # token ids, token text, counts: exactly
        assert np.array_equal(x, y), where
        return
    seen.float_arrays += 1
    if x.tobytes() != y.tobytes():
        seen.differing_bits += 1
        seen.differing.append(where)
    scale = float(np.abs(x).max()) if x.size else 0.0
    difference = float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max()) if x.size else 0.0
    relative = difference / scale if scale > 0 else difference
    seen.largest_relative = max(seen.largest_relative, relative)
    assert relative <= ROUNDING.get(x.dtype, 1e-2), f"{where}: differs by {relative:.2e} of its scale"


def _compare_attrs(a: Any, b: Any, tolerance: float, where: str, measured: bool = False) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(set(a) ^ set(b))} in one only"
        for key in a:
            _compare_attrs(a[key], b[key], tolerance, f"{where}/{key}", measured or key in MEASURED)
    elif isinstance(a, float) and isinstance(b, float) and measured:
        assert abs(a - b) <= tolerance, f"{where}: {a!r} against {b!r}"
    elif isinstance(a, float) and isinstance(b, float):  # a sum of squares and the like: relative to its size
        assert abs(a - b) <= tolerance * max(abs(a), abs(b)), f"{where}: {a!r} against {b!r}"
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} against {b!r}"


def assert_all_equal(x: np.ndarray, y: np.ndarray) -> None:
    assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)


def reseal(folder: Path) -> None:
    """Recompute the integrity record of a damaged group, as a writer would have: the damage then reaches the
    checks behind the seal (chunk checksums, reconstruction, spectra)."""
    import json

    from detjac.store.integrity import INTEGRITY, seal

    meta_file = folder / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["attributes"][INTEGRITY] = seal(folder, meta["attributes"])
    meta_file.write_text(json.dumps(meta))
