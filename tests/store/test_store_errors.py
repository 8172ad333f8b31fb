"""The store refuses what it cannot do safely, with a message that says why, and leaves what is there untouched.

Without a run: stores come from ``detjac.store.testing``; `detjac run`'s own refusals of bad input are
in tests/runs/test_run_errors.py.
"""

from __future__ import annotations

import errno
import json

import numpy as np
import pytest

from detjac.errors import StoreError, StoreFormatError, StoreMismatchError
from detjac.store import create_store, open_store
from detjac.store.testing import make_store

RUN = {"model_id": "m", "model_type": "llama", "config_sha256": "c", "revision": None, "dtype": "float64",
       "keep": "full", "detach": True, "position": -1, "target": "hidden", "row_block": 2}


def snapshot(path):
    """Every file under ``path`` and its bytes (the writer lock's holder record aside)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.parent.name != "_writer"}


def test_not_a_store(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"jpeg")
    with pytest.raises(StoreFormatError, match="Expected a detjac store .a zarr v3 folder with zarr.json.*Got a folder "
                                               "without zarr.json"):
        create_store(folder, RUN)
    assert [p.name for p in folder.iterdir()] == ["cat.jpg"]
    with pytest.raises(StoreFormatError, match="Got a file instead"):
        open_store(folder / "cat.jpg")
    with pytest.raises(StoreFormatError, match="Got no such file or folder"):
        open_store(tmp_path / "missing.zarr")
    (folder / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    with pytest.raises(StoreFormatError, match="without the 'detjac_store' attribute"):
        open_store(folder)
    with pytest.raises(StoreFormatError, match="without the 'detjac_store' attribute"):
        create_store(folder, RUN)
    (folder / "zarr.json").write_text("{not json")
    with pytest.raises(StoreFormatError, match="Expected readable JSON in"):
        open_store(folder)


def test_object_store_urls_are_refused_with_a_pointer():
    with pytest.raises(StoreError, match=r"Expected a store on a POSIX file system .* Got 's3://b/run.zarr' .s3:// has "
                                         "no atomic rename or lock.*'Object stores' in docs/store-format.md"):
        open_store("s3://b/run.zarr")


def test_file_urls_name_local_stores(tmp_path):
    made = make_store(tmp_path / "s.zarr", prompts=1)
    assert open_store(f"file://{made.path}").prompt_ids() == made.ids


def test_newer_format_version_is_refused(tmp_path):
    made = make_store(tmp_path / "s.zarr", prompts=1)
    meta_file = made.path / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["attributes"]["detjac_store"]["format_version"] = 99
    meta_file.write_text(json.dumps(meta))
    before = snapshot(made.path)
    with pytest.raises(StoreFormatError, match="Expected store format version <= 2 .* Got 99: .* upgrade detjac"):
        open_store(made.path)
    with pytest.raises(StoreFormatError, match="Got 99"):
        create_store(made.path, made.run)
    assert snapshot(made.path) == before


def test_a_store_of_another_run_is_refused_unless_forced(tmp_path):
    made = make_store(tmp_path / "s.zarr", prompts=2)
    before = snapshot(made.path)
    other = dict(made.run, dtype="float32", model_id="tiny-llama")
    with pytest.raises(StoreMismatchError, match=r"Expected the store .* to hold the same run. Got differences: "
                                                 r"model_id: 'synthetic' \(store\) != 'tiny-llama'; dtype: 'float64' "
                                                 r"\(store\) != 'float32'. Use --force-new"):
        create_store(made.path, other)
    assert snapshot(made.path) == before
    with create_store(made.path, dict(made.run, row_block=64)) as resumed:  # not identity: resumed as it is
        assert resumed.prompt_ids() == made.ids and resumed.run == made.run
    resumed_once = snapshot(made.path)  # the resume cleared the staging leftovers
    with create_store(made.path, other, force_new=True) as replaced:
        assert replaced.prompt_ids() == [] and replaced.run == other
    assert replaced.restored == made.path and snapshot(made.path) == resumed_once  # no prompt stored: it is back


def test_force_new_keeps_the_old_store_until_the_new_run_holds_a_prompt(tmp_path):
    import os

    from detjac.store.testing import run_description, synthetic_model, synthetic_prompt, write_prompt

    made = make_store(tmp_path / "s.zarr", prompts=2)
    before = snapshot(made.path)
    model = synthetic_model(seed=4)
    other = run_description(model, n_layers=2, model_id="other")
    with pytest.raises(RuntimeError, match="the run failed"):  # a run that fails before its first prompt
        with create_store(made.path, other, force_new=True, model_data=lambda: model.model_data("float64")) as new:
            [aside] = tmp_path.glob(f".s.zarr.replaced-{os.getpid()}-*")  # a name no one could plant a link at
            assert aside.is_dir() and new.run == other
            new.record_failure("f" * 16, {"prompt": "x", "line": 1, "reason": "nan", "error": "nan", "stage": "x"})
            raise RuntimeError("the run failed")
    assert snapshot(made.path) == before and not aside.exists()
    with create_store(made.path, other, force_new=True, model_data=lambda: model.model_data("float64")) as new:
        write_prompt(new, model, other, synthetic_prompt(model, other, "a new prompt", n_layers=2))
    assert new.restored is None and not aside.exists() and open_store(made.path).run == other
    assert len(open_store(made.path)) == 1
    assert np.array_equal(open_store(made.path).model_array("embedding"), model.embedding)  # the new model's


def test_a_killed_force_new_run_gives_the_old_store_back_to_the_next_writer(tmp_path):
    made = make_store(tmp_path / "s.zarr", prompts=2)
    create_store(made.path, made.run).close()  # a writer clears the factory's staging leftovers
    before = snapshot(made.path)
    other = dict(made.run, model_id="other")
    dead = 2**22 + 12345  # no such process
    with create_store(made.path, other, force_new=True):
        pass
    assert snapshot(made.path) == before
    (tmp_path / "s.zarr").rename(tmp_path / f".s.zarr.replaced-{dead}")  # as a kill -9 leaves it: the old store
    create_store(tmp_path / "new.zarr", other).close()  # aside, and a new prompt-less one in its place
    (tmp_path / "new.zarr").rename(tmp_path / "s.zarr")
    with create_store(made.path, made.run) as resumed:
        assert resumed.restored_earlier == tmp_path / f".s.zarr.replaced-{dead}"
        assert resumed.prompt_ids() == made.ids
    assert snapshot(made.path) == before and not (tmp_path / f".s.zarr.replaced-{dead}").exists()


def test_read_only_target(tmp_path, monkeypatch):
    import os

    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if mode == os.W_OK else real_access(p, mode))
    with pytest.raises(StoreError, match=f"Could not create the store .*: {tmp_path} is not writable"):
        create_store(tmp_path / "s.zarr", RUN)
    assert not (tmp_path / "s.zarr").exists()


def test_second_writer_is_refused(tmp_path):
    with create_store(tmp_path / "s.zarr", RUN):
        with pytest.raises(StoreError, match="Expected no other writer on .* Got one running"):
            create_store(tmp_path / "s.zarr", RUN)
        with pytest.raises(StoreError, match="Got one running"):  # nor may --force-new delete it under the writer
            create_store(tmp_path / "s.zarr", dict(RUN, dtype="float32"), force_new=True)
        assert (tmp_path / "s.zarr" / "zarr.json").is_file()
    create_store(tmp_path / "s.zarr", RUN).close()  # free again once the first is closed


def _write(store, pid, rows=4):
    with store.begin(pid, n_rows=rows, n_tokens=3, n_cols=4, dtype="float64", row_block=2) as w:
        for start in range(0, rows, 2):
            w.write_rows(start, start + 2, np.ones((2, 3, 4)))
        w.write_array("embeddings", np.ones((3, 4)))
        w.write_array("output", np.full(rows, 12.0))
        w.write_array("token_ids", np.arange(3))
        w.commit({"prompt": pid, "n_tokens": 3, "reconstruction_error": 0.0, "dtype": "float64"})


def test_out_of_disk_at_commit_leaves_no_visible_partial_prompt(tmp_path, monkeypatch):
    from detjac.store.backend import zarr_writer

    path = tmp_path / "s.zarr"
    with create_store(path, RUN) as store:
        _write(store, "f1" * 8)
        monkeypatch.setattr(zarr_writer.os, "rename",
                            lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
        with pytest.raises(StoreError, match="Could not commit prompt 5e5e5e5e5e5e5e5e: the disk is full"):
            _write(store, "5e" * 8)
        assert store.staging_leftovers() == []
    assert open_store(path).prompt_ids() == ["f1" * 8]


def test_disk_full_inside_zarr_becomes_a_store_error(tmp_path, monkeypatch):
    import zarr

    path = tmp_path / "s.zarr"
    with create_store(path, RUN) as store:
        writer = store.begin("0" * 16, n_rows=2, n_tokens=3, n_cols=4, dtype="float64", row_block=2)
        monkeypatch.setattr(zarr.Array, "__setitem__",
                            lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
        with pytest.raises(StoreError, match="Could not write prompt 0{16}: the disk is full. Nothing half-written"):
            writer.write_rows(0, 2, np.ones((2, 3, 4)))
        assert store.staging_leftovers() == []
    assert open_store(path).prompt_ids() == []


def test_leftovers_of_a_killed_creation_are_removed(tmp_path):
    dead = tmp_path / ".s.zarr.tmp-999999999"  # no such process
    dead.mkdir()
    (dead / "zarr.json").write_text("{}")
    create_store(tmp_path / "s.zarr", RUN).close()
    assert not dead.exists() and open_store(tmp_path / "s.zarr").prompt_ids() == []
