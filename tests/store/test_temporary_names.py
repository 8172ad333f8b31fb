"""Temporary names no one can plant a link at: every write beside its destination goes through a
new entry created exclusively under an unpredictable name (``detjac.aside``), so a symbolic link planted at the
name a writer used to choose (``.NAME.tmp-<pid>``, ``.NAME.<pid>.tmp``, ``.NAME.old-<pid>``) is never written
through, and nothing of the writer is left beside its destination."""

from __future__ import annotations

import os

import numpy as np
import pytest

from detjac.aside import aside_pid, write_file
from detjac.store import create_store
from detjac.store.backend.disk import aside_entries, write_npz
from detjac.store.backend.sealed import write_sealed
from detjac.store.testing import make_store
from detjac.view.static_export import export_static


def _plant(folder, name, victim):
    """Links at every name a writer of ``name`` in ``folder`` used to choose, all to ``victim``."""
    pid = os.getpid()
    for planted in (f".{name}.tmp-{pid}", f".{name}.{pid}.tmp", f".{name}.old-{pid}", f".{name}.{pid}",
                    f".{name}.replaced-{pid}"):
        (folder / planted).symlink_to(victim)


def test_a_file_written_aside_never_follows_a_planted_link(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    _plant(tmp_path, "out.npz", victim)
    write_npz(tmp_path / "out.npz", {"a": np.arange(3)})
    assert victim.read_text() == "precious"
    assert np.load(tmp_path / "out.npz")["a"].tolist() == [0, 1, 2]
    before = {p.name for p in tmp_path.iterdir()}
    write_file(tmp_path / "t.txt", lambda handle: handle.write("x"), "w")  # the variant: text, no leftovers
    assert {p.name for p in tmp_path.iterdir()} == before | {"t.txt"}


def test_a_sealed_group_never_follows_a_planted_link_to_a_folder(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    group = tmp_path / "g"
    group.mkdir()
    (group / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    _plant(group, "svd", victim)
    write_sealed(group, "svd", {"s": np.ones(2)}, {"k": 1}, "write svd")
    write_sealed(group, "svd", {"s": np.zeros(2)}, {"k": 2}, "write svd")  # replaced: the old one set aside
    assert list(victim.iterdir()) == []
    assert sorted(p.name for p in group.iterdir() if not p.is_symlink()) == ["svd", "zarr.json"]


def test_a_store_and_a_snapshot_are_never_built_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    _plant(tmp_path, "s.zarr", victim)
    _plant(tmp_path, "snap", victim)
    store = make_store(tmp_path / "s.zarr", prompts=1)
    export_static(store.open(), tmp_path / "snap")
    assert list(victim.iterdir()) == []
    other = {**store.run, "model_id": "other"}  # the variant: --force-new sets the old store aside
    with create_store(store.path, other, force_new=True, model_data=lambda: store.model.model_data("float64")):
        assert list(victim.iterdir()) == []
    assert (tmp_path / "snap" / "index.html").is_file() and not (tmp_path / "snap").is_symlink()


@pytest.mark.parametrize(("name", "pid"), [(".s.zarr.tmp-12", 12), (".s.zarr.old-7-ab_3xQ9z", 7),
                                           (".s.zarr.tmp-", None), ("s.zarr.tmp-3", None)])
def test_the_writer_of_a_temporary_name_is_recognised(name, pid):
    assert aside_pid(name) == pid
    assert aside_pid(name, "other") is None


def test_what_a_killed_writer_left_is_listed(tmp_path):
    dead = tmp_path / ".svd.tmp-999999999-abcdefgh"
    dead.mkdir()
    assert aside_entries(tmp_path) == [dead]


def test_what_is_written_aside_has_the_permissions_open_and_mkdir_give(tmp_path):
    import stat

    umask = os.umask(0o022)
    try:
        write_file(tmp_path / "f.txt", lambda handle: handle.write("x"), "w")
        store = make_store(tmp_path / "s.zarr", prompts=1)
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "f.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o755
