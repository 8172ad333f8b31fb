"""The running lens sums of a `detjac run --lens` process: flushed as partials that count each prompt once."""

from __future__ import annotations

import numpy as np
import pytest

from detjac.analysis.lens import lens_fit
from detjac.analysis.lens.lens_sums import RunningSums
from detjac.errors import StoreError
from detjac.store.testing import make_store


@pytest.fixture
def store(tmp_path):
    return make_store(tmp_path / "s.zarr", prompts=3, d_model=4, n_tokens=3, n_layers=2, targets=("layer.0",)).open()


def blocks(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 4, 4))  # (layer, row, col)


def partial_ids(store, layer: int) -> list[list[str]]:
    return sorted(store.read_lens(n, arrays=False)[1]["prompt_ids"] for n in store.lens_names()
                  if n.startswith(f"partial-{layer}-"))


def test_sums_are_flushed_every_k_prompts_replacing_the_previous_partial(store):
    sums = RunningSums([0, 1], flush_every=2)
    sums.add(store, "a", blocks(1))
    assert store.lens_names() == []  # not flushed yet
    sums.add(store, "b", blocks(2))
    assert partial_ids(store, 0) == [["a", "b"]] and partial_ids(store, 1) == [["a", "b"]]
    sums.add(store, "a", blocks(1))  # counted already: left out
    sums.add(store, "c", blocks(3))
    assert partial_ids(store, 0) == [["a", "b", "c"]]  # the wider partial replaced the narrower one
    total, square, ids = lens_fit.merge(store, 1, {"a", "b", "c"})
    expected = np.stack([blocks(s)[1] for s in (1, 2, 3)])
    assert ids == ["a", "b", "c"]
    np.testing.assert_allclose(total, expected.sum(0), rtol=1e-15)
    np.testing.assert_allclose(square, (expected**2).sum(0), rtol=1e-15)


def test_a_new_process_never_recounts_what_partials_already_count(store):
    first = RunningSums([0, 1])
    first.add(store, "a", blocks(1))
    second = RunningSums([0, 1])
    second.add(store, "a", blocks(1))  # a retried prompt whose sums another process already wrote
    second.add(store, "b", blocks(2))
    assert sorted(map(tuple, partial_ids(store, 0))) == [("a",), ("b",)]
    assert lens_fit.lens_counted(store, [0, 1], {"a", "b", "c"}) == {"a", "b"}


def test_overlapping_partials_are_refused_by_name(store):
    lens_fit.write_partial(store, 0, ["a", "b"], np.ones((4, 4)), np.ones((4, 4)))
    lens_fit.write_partial(store, 0, ["b", "c"], np.ones((4, 4)), np.ones((4, 4)))
    with pytest.raises(StoreError, match=r"both count 1 prompt\(s\) \(b\): they would be counted twice"):
        lens_fit.partials(store, 0, {"a", "b", "c"})
    lens_fit.write_partial(store, 1, ["a", "b", "c"], np.ones((4, 4)), np.ones((4, 4)))
    lens_fit.write_partial(store, 1, ["a", "b"], np.ones((4, 4)), np.ones((4, 4)))  # a merge's leftover source
    assert [ids for _, ids in lens_fit.partials(store, 1, {"a", "b", "c"})] == [["a", "b", "c"]]
