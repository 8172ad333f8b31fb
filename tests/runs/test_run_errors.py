"""Bad input to `detjac run`: a clear message, and the store left untouched (the store's own refusals, without a
run, are in tests/store/test_store_errors.py)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from store_helpers import PROMPTS, store_snapshot, write_prompts

from detjac.cli.main import main
from detjac.store import open_store


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
    expected = 'Expected {"prompt": "..."} (or "text"; or token ids, {"prompt": [1, 2, 3]}) on line 2'
    assert expected in run_fails(tmp_path, bad)
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


def test_newer_format_version_is_refused(tmp_path, one_prompt_store):
    meta_file = one_prompt_store / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["attributes"]["detjac_store"]["format_version"] = 99
    meta_file.write_text(json.dumps(meta))
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:1])
    assert "Got 99" in run_fails(tmp_path, prompts, out=one_prompt_store)


def test_store_of_another_model_is_refused(tmp_path, one_prompt_store, llama_checkpoint):
    prompts = write_prompts(tmp_path / "p.txt", ["The fog rolls over the"])
    before = store_snapshot(one_prompt_store)
    result = CliRunner().invoke(main, ["run", str(llama_checkpoint), str(prompts), "--out", str(one_prompt_store)])
    assert result.exit_code == 1
    assert "Expected the store" in result.output and "model_id: 'gcide-llama' (store) != 'tiny-llama'" in result.output
    assert "config_sha256" in result.output and store_snapshot(one_prompt_store) == before


def test_a_run_refused_before_its_first_prompt_leaves_no_store_it_created(tmp_path, one_prompt_store, monkeypatch):
    from detjac import exactness

    monkeypatch.setattr(exactness, "relative_error", lambda *a: float("nan"))  # as a NaN in the model would
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[1:2])
    out = run_fails(tmp_path, prompts)
    assert "float64 reconstruction error nan is above 1e-09; a nonlinearity escaped detaching" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt", "s.zarr"]  # new.zarr went with the refusal
    before = store_snapshot(one_prompt_store)
    run_fails(tmp_path, prompts, out=one_prompt_store)  # a store that already held prompts is kept
    assert store_snapshot(one_prompt_store) == before
