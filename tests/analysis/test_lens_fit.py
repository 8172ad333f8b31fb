"""The lens fitted from a store: the mean of the stored same-position operators, resumable, distributed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from detjac.analysis import lens as lenses
from detjac.analysis.lens import lens_fit
from detjac.errors import InvalidArgumentError
from detjac.store import open_store
from detjac.store.integrity import CorruptError
from detjac.store.testing import make_store

TARGETS = ("to_output.0", "to_output.1", "layer.1")


@pytest.fixture
def synthetic(tmp_path):
    return make_store(tmp_path / "s.zarr", prompts=7, d_model=6, n_tokens=4, n_layers=2, targets=TARGETS)


def numpy_lens(synthetic, layer):
    """The same-position blocks from the truth the store was written from, averaged by numpy."""
    blocks = np.stack([t.layerwise[f"to_output.{layer}"].jacobian[:, -1, :] for t in synthetic.prompts.values()])
    return blocks.mean(axis=0), (blocks**2).mean(axis=0)


def test_fitted_mean_equals_the_numpy_mean_of_the_stored_operators(synthetic):
    store = synthetic.open()
    report = lens_fit.fit_lens(store, chunk=3)
    assert report["layers"] == [0, 1] and report["count"] == [7, 7] and report["tasks"] == 6
    lens = lenses.load_lens(synthetic.path)
    assert lens.kind == "detached" and lens.info["n_prompts"] == 7
    for i, layer in enumerate((0, 1)):
        stored = np.stack([np.asarray(store.get(pid).layerwise(f"to_output.{layer}")[:, -1, :])
                           for pid in store.prompt_ids()])
        assert np.abs(lens.mean[i] - stored.mean(axis=0)).max() < 1e-12
        mean, second = numpy_lens(synthetic, layer)
        assert np.abs(lens.mean[i] - mean).max() < 1e-12
        assert np.abs(lens.second_moment[i] - second).max() < 1e-12
    assert np.all(lenses.relative_spread(lens) > 0)
    assert [n for n in store.lens_names() if n.startswith("partial")] == sorted(
        lens_fit.partial_name(layer, store.prompt_ids()) for layer in (0, 1))  # merged to one per layer
    assert all(r.ok for r in store.verify())


def test_a_second_fit_reuses_the_partials_and_only_new_layers_are_computed(synthetic):
    store = synthetic.open()
    first = lens_fit.fit_lens(store, layers=[-1], chunk=2)
    assert first["layers"] == [1] and first["tasks"] == 4
    again = lens_fit.fit_lens(store, chunk=2)
    assert again["tasks"] == 4 and again["reused"] == 7  # layer 0 computed, layer 1 reused


def test_a_store_without_to_output_targets_names_the_run_options(tmp_path):
    plain = make_store(tmp_path / "p.zarr", prompts=2, targets=("layer.0",))
    with pytest.raises(InvalidArgumentError, match="--layers all --components to_output"):
        lens_fit.fit_lens(plain.open())
    with pytest.raises(InvalidArgumentError, match="Expected layers with stored to_output targets"):
        lens_fit.fit_lens(make_store(tmp_path / "q.zarr", prompts=2, targets=("to_output.0",)).open(), layers=[1])


def test_save_load_and_a_damaged_lens_is_refused(synthetic, tmp_path):
    lens_fit.fit_lens(synthetic.open())
    lens = lenses.load_lens(synthetic.path)
    with pytest.raises(InvalidArgumentError, match="Expected an existing folder for .*gcide.lens. Got none at"):
        lenses.save_lens(lens, tmp_path / "shared" / "gcide.lens")  # a missing folder is refused, as for any output
    (tmp_path / "shared").mkdir()
    saved = lenses.save_lens(lens, tmp_path / "shared" / "gcide.lens")
    back = lenses.load_lens(saved)
    assert np.array_equal(back.mean, lens.mean) and back.info == lens.info
    with pytest.raises(InvalidArgumentError, match="exists"):
        lenses.save_lens(lens, saved)
    chunk = next(p for p in (saved / "mean").rglob("*") if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(chunk.read_bytes()[:-1] + bytes([chunk.read_bytes()[-1] ^ 1]))
    with pytest.raises(CorruptError, match="changed since commit"):
        lenses.load_lens(saved)
    (synthetic.path / "lens" / "fitted" / "count" / "zarr.json").write_text("{}")
    assert any(not r.ok and r.kind == "lens" for r in synthetic.open().verify())


def test_save_force_replaces_a_saved_lens_and_nothing_else(synthetic, tmp_path):
    lens_fit.fit_lens(synthetic.open())
    lens = lenses.load_lens(synthetic.path)
    saved = lenses.save_lens(lens, tmp_path / "a.lens")
    assert lenses.save_lens(lens, saved, force=True) == saved and lenses.load_lens(saved).info == lens.info
    other = tmp_path / "papers"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    link = tmp_path / "link.lens"
    link.symlink_to(saved)
    extra = tmp_path / "b.lens"
    lenses.save_lens(lens, extra)
    (extra / "notes.txt").write_text("mine")
    for target, what in ((synthetic.path, "a detjac store"), (other, "not a saved lens"), (link, "symbolic link"),
                         (extra, "other files beside it"), (tmp_path / "papers" / "notes.txt", "a file")):
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        with pytest.raises(InvalidArgumentError, match=f"replaces only a lens.*{what}"):
            lenses.save_lens(lens, target, force=True)
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing deleted or added
    assert len(synthetic.open()) > 0 and (other / "notes.txt").read_text() == "mine"


SLOW_FIT = """
import sys, time
from detjac.analysis.lens import lens_fit
from detjac.store import open_store
commit = lens_fit.fit_partial
def slow(*args):
    name = commit(*args)
    print(name, flush=True)
    time.sleep(0.5)
    return name
lens_fit.fit_partial = slow
lens_fit.fit_lens(open_store(sys.argv[1]), chunk=1)
"""


def test_a_fit_killed_mid_way_resumes_to_the_same_lens(synthetic, tmp_path):
    copy = tmp_path / "copy.zarr"
    shutil.copytree(synthetic.path, copy)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen([sys.executable, "-c", SLOW_FIT, str(synthetic.path)], stdout=subprocess.PIPE, env=env,
                             text=True)
    committed = [child.stdout.readline() for _ in range(3)]  # three partials on disk, eleven to go
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert all(line.startswith("partial-") for line in committed)
    store = open_store(synthetic.path)
    assert store.read_lens(lenses.FITTED) is None
    resumed = lens_fit.fit_lens(store, chunk=1)
    assert resumed["reused"] >= 3 and resumed["tasks"] == 14 - resumed["reused"]
    lens_fit.fit_lens(open_store(copy), chunk=1)
    a, b = lenses.load_lens(synthetic.path), lenses.load_lens(copy)
    assert np.abs(a.mean - b.mean).max() < 1e-13 and np.array_equal(a.count, b.count)
    assert np.abs(a.second_moment - b.second_moment).max() < 1e-13


def test_a_fit_is_refused_while_another_process_writes_the_store(synthetic):
    from detjac.errors import StoreError
    from detjac.store.backend import lock

    held = lock.acquire(synthetic.path)  # as a running `detjac run --lens` or another fit holds it
    try:
        with pytest.raises(StoreError, match=r"Expected no other writer on .* Got one running \(pid "):
            lens_fit.fit_lens(synthetic.open(), chunk=3)
        assert [n for n in synthetic.open().lens_names()] == []  # refused before any partial was written
    finally:
        lock.release(held)
    assert lens_fit.fit_lens(synthetic.open(), chunk=3)["count"] == [7, 7]
    assert lock.holder(synthetic.path) is None  # released by the fit


def test_overlapping_partials_left_by_writers_at_once_are_repaired_by_the_next_fit(synthetic, tmp_path):
    store = synthetic.open()
    ids = store.prompt_ids()
    for layer in (0, 1):  # two writers that ran at once: prompt ids[2] counted in both partials of each layer
        for part in (ids[:3], ids[2:5]):
            blocks = [lens_fit.same_position_operator(store.get(pid), layer) for pid in part]
            lens_fit.write_partial(store, layer, part, sum(blocks), sum(b * b for b in blocks))
    with pytest.raises(Exception, match="they would be counted twice. `detjac lens fit STORE` repairs this"):
        lens_fit.partials(store, 0, set(ids))  # a reader only reports it
    report = lens_fit.fit_lens(synthetic.open(), chunk=2)
    assert report["count"] == [7, 7]
    lens = lenses.load_lens(synthetic.path)
    for i, layer in enumerate((0, 1)):
        mean, second = numpy_lens(synthetic, layer)
        assert np.abs(lens.mean[i] - mean).max() < 1e-12 and np.abs(lens.second_moment[i] - second).max() < 1e-12
    assert all(r.ok for r in open_store(synthetic.path).verify())
