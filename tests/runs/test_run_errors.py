"""Bad input to `detjac run` and the store: a clear message, and the store left untouched."""

from __future__ import annotations

import errno
import json

import numpy as np
import pytest
from click.testing import CliRunner
from store_helpers import PROMPTS, store_snapshot, write_prompts

from detjac.cli.main import main
from detjac.errors import StoreError, StoreFormatError
from detjac.store import create_store, open_store

RUN = {"model_id": "m", "model_type": "llama", "config_sha256": "c", "revision": None, "dtype": "float64",
       "keep": "full", "detach": True, "position": -1, "target": "hidden", "row_block": 2}


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def one_prompt_store(tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:1])
    out = tmp_path / "s.zarr"
    assert invoke("run", "default", str(prompts), "--out", str(out)).exit_code == 0
    return out


def run_fails(tmp_path, prompts_path, *extra: str, out=None):
    out = out or tmp_path / "new.zarr"
    result = invoke("run", "default", str(prompts_path), "--out", str(out), *extra)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    return result.output


def test_missing_prompts_file(tmp_path):
    out = run_fails(tmp_path, tmp_path / "nope.txt")
    assert f"Expected a prompts file at {tmp_path / 'nope.txt'}. Got no such file." in out
    assert not (tmp_path / "new.zarr").exists()


def test_prompts_path_is_a_folder(tmp_path):
    assert "Got a folder." in run_fails(tmp_path, tmp_path)


def test_unreadable_prompts_file(tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"ok line\n\xff\xfe binary\n")
    assert "Expected UTF-8 text in" in run_fails(tmp_path, bad)
    assert not (tmp_path / "new.zarr").exists()


def test_empty_and_blank_only_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert f"Expected at least one prompt in {empty}. Got an empty file." in run_fails(tmp_path, empty)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    assert "Got an empty file (3 blank lines)." in run_fails(tmp_path, blank)


def test_malformed_jsonl(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"title": "no prompt key"}\n')
    assert 'Expected {"prompt": "..."} (or "text") on line 2' in run_fails(tmp_path, bad)
    bad.write_text('{"prompt": "fine"}\n{not json\n')
    assert "Expected a JSON object on line 2" in run_fails(tmp_path, bad)


def test_jsonl_metadata_is_kept(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"prompt": PROMPTS[1], "topic": "trees"}) + "\n")
    assert invoke("run", "default", str(good), "--out", str(tmp_path / "s.zarr")).exit_code == 0
    assert next(iter(open_store(tmp_path / "s.zarr"))).attrs["meta"] == {"topic": "trees"}


def test_too_long_prompt_writes_nothing(tmp_path, one_prompt_store):
    prompts = write_prompts(tmp_path / "long.txt", [PROMPTS[1], PROMPTS[5]])
    before = store_snapshot(one_prompt_store)
    out = run_fails(tmp_path, prompts, "--max-tokens", "12", out=one_prompt_store)
    assert "Expected prompts of at most 12 tokens (--max-tokens). Got longer ones in" in out
    assert "line 1 (" in out and "line 2 (" in out and "Nothing was written." in out
    assert store_snapshot(one_prompt_store) == before
    context = write_prompts(tmp_path / "ctx.txt", ["word " * 400])
    assert "at most 256 tokens (the model's max_position_embeddings)" in run_fails(tmp_path, context)


def test_not_a_store(tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:1])
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"jpeg")
    assert "Expected a detjac store (a zarr v3 folder with zarr.json)" in run_fails(tmp_path, prompts, out=folder)
    assert [p.name for p in folder.iterdir()] == ["cat.jpg"]
    with pytest.raises(StoreFormatError, match="Got a file instead"):
        open_store(folder / "cat.jpg")
    with pytest.raises(StoreFormatError, match="Got no such file or folder"):
        open_store(tmp_path / "missing.zarr")
    (folder / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    with pytest.raises(StoreFormatError, match="without the 'detjac_store' attribute"):
        open_store(folder)


def test_newer_format_version_is_refused(tmp_path, one_prompt_store):
    meta_file = one_prompt_store / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["attributes"]["detjac_store"]["format_version"] = 99
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(StoreFormatError, match="Expected store format version <= 1 .* Got 99: .* upgrade detjac"):
        open_store(one_prompt_store)
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:1])
    assert "Got 99" in run_fails(tmp_path, prompts, out=one_prompt_store)


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
    from detjac.store import zarr_writer

    path = tmp_path / "s.zarr"
    with create_store(path, RUN) as store:
        _write(store, "first")
        monkeypatch.setattr(zarr_writer.os, "rename",
                            lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
        with pytest.raises(StoreError, match="Could not commit prompt second: the disk is full"):
            _write(store, "second")
        assert store.staging_leftovers() == []
    assert open_store(path).prompt_ids() == ["first"]


def test_disk_full_inside_zarr_becomes_a_store_error(tmp_path, monkeypatch):
    import zarr

    path = tmp_path / "s.zarr"
    with create_store(path, RUN) as store:
        writer = store.begin("p", n_rows=2, n_tokens=3, n_cols=4, dtype="float64", row_block=2)
        monkeypatch.setattr(zarr.Array, "__setitem__",
                            lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
        with pytest.raises(StoreError, match="Could not write prompt p: the disk is full. Nothing half-written"):
            writer.write_rows(0, 2, np.ones((2, 3, 4)))
        assert store.staging_leftovers() == []
    assert open_store(path).prompt_ids() == []


def test_store_of_another_model_is_refused(tmp_path, one_prompt_store, llama_checkpoint):
    prompts = write_prompts(tmp_path / "p.txt", ["The fog rolls over the"])
    before = store_snapshot(one_prompt_store)
    result = CliRunner().invoke(main, ["run", str(llama_checkpoint), str(prompts), "--out", str(one_prompt_store)])
    assert result.exit_code == 1
    assert "Expected the store" in result.output and "model_id: 'gcide-llama' (store) != 'tiny-llama'" in result.output
    assert "config_sha256" in result.output and store_snapshot(one_prompt_store) == before


def test_leftovers_of_a_killed_creation_are_removed(tmp_path):
    dead = tmp_path / ".s.zarr.tmp-999999999"  # no such process
    dead.mkdir()
    (dead / "zarr.json").write_text("{}")
    create_store(tmp_path / "s.zarr", RUN).close()
    assert not dead.exists() and open_store(tmp_path / "s.zarr").prompt_ids() == []
