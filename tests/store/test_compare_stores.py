"""``detjac.store.compare_stores``: two stores of one run agree within rounding, and every other difference is
named."""

from __future__ import annotations

import shutil

import numpy as np
import zarr

from detjac.store import compare_stores
from detjac.store.testing import make_store


def _nudged(path, pid: str, relative: float) -> None:
    """Add ``relative`` of the Jacobian's scale to one of its entries, in place (behind the seal's back: the
    comparison reads every array as it is)."""
    array = zarr.open_group(str(path / "prompts" / pid), mode="r+")["jacobian"]
    values = np.asarray(array[...])
    values[0, 0, 0] += relative * float(np.abs(values).max())
    array[...] = values


def test_the_same_run_twice_is_equivalent_with_the_same_bits(tmp_path):
    a, b = make_store(tmp_path / "a.zarr", prompts=2), make_store(tmp_path / "b.zarr", prompts=2)
    seen = compare_stores(a.path, b.path)
    assert seen.equivalent and seen.differences == [] and seen.differing_bits == 0
    assert seen.float_arrays >= 2 * 3 and seen.largest_relative == 0.0  # jacobian, embeddings, output per prompt


def test_rounding_is_equivalent_and_more_is_a_difference(tmp_path):
    a = make_store(tmp_path / "a.zarr", prompts=2)
    b, c = (shutil.copytree(a.path, tmp_path / name) for name in ("b.zarr", "c.zarr"))
    pid = a.ids[0]
    _nudged(b, pid, 1e-14)
    seen = compare_stores(a.path, b)
    assert seen.equivalent and seen.differing == [f"{pid}/jacobian"] and 0 < seen.largest_relative < 1e-12
    _nudged(c, pid, 1e-6)
    seen = compare_stores(a.path, c)
    assert not seen.equivalent and len(seen.differences) == 1
    assert seen.differences[0].startswith(f"{pid}/jacobian: differs by 1.00e-06")


def test_other_prompts_or_another_run_are_named(tmp_path):
    a = make_store(tmp_path / "a.zarr", prompts=2)
    fewer = make_store(tmp_path / "b.zarr", prompts=1)
    other = make_store(tmp_path / "c.zarr", prompts=2, seed=1)
    assert any(d.startswith("prompts in one store only") for d in compare_stores(a.path, fewer.path).differences)
    assert "the run descriptions differ" in compare_stores(a.path, other.path).differences
