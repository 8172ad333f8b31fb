"""A damaged store never reads back as numbers: each damage is named, by reads and by verify, and nothing outside
the store is read or written.

Each test damages a copy of a store written by the real writer (``detjac.store.testing``) and checks
the exact message and that the folder around the store is unchanged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import zarr
from click.testing import CliRunner
from store_helpers import reseal

from detjac.cli.main import main
from detjac.errors import InvalidArgumentError, StoreError, StoreFormatError
from detjac.store import create_store, open_store
from detjac.store.integrity import CorruptError
from detjac.store.testing import make_store

FORMAT1 = Path(__file__).parent.parent / "data" / "format1"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def snapshot(folder: Path, skip: Path | None = None) -> dict[str, bytes]:
    """Every file under ``folder`` (outside ``skip``) and its bytes."""
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink() and (skip is None or skip not in p.parents)}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Stores written once per module (a full one with layerwise targets and analysis results, a low-rank one);
    each test damages its own copy."""
    folder = tmp_path_factory.mktemp("pristine")
    made = make_store(folder / "s.zarr", prompts=3, targets=["layer.0", "mlp_local.1"])
    assert invoke("analyze", "svd", made.path, "--k", "2").exit_code == 0
    return made, make_store(folder / "low.zarr", prompts=2, keep="rank:2")


def _copy(made, path: Path) -> SimpleNamespace:
    shutil.copytree(made.path, path)
    return SimpleNamespace(path=path, ids=made.ids, run=made.run, open=lambda: open_store(path))


@pytest.fixture
def full(pristine, tmp_path):
    return _copy(pristine[0], tmp_path / "s.zarr")


@pytest.fixture
def low(pristine, tmp_path):
    return _copy(pristine[1], tmp_path / "low.zarr")


def corrupt_lines(result) -> list[str]:
    return re.findall(r"CORRUPT [^\n]*", result.output)  # a progress bar may share the line before


# -- 1. missing chunks ---------------------------------------------------------------------------


def test_a_deleted_jacobian_shard_is_an_error_on_read_in_analyses_and_in_verify(full):
    pid = full.ids[0]
    shard = next((full.path / "prompts" / pid / "jacobian" / "c").rglob("*"))
    while shard.is_dir():
        shard = next(shard.iterdir())
    rel = shard.relative_to(full.path / "prompts" / pid).as_posix()
    shard.unlink()
    with pytest.raises(CorruptError, match=rf"Expected an intact prompt {pid} in .*Got a damaged one: missing file "
                                           rf"{rel}\. `detjac store verify` checks every prompt\."):
        open_store(full.path).get(pid)
    svd = invoke("analyze", "svd", full.path, "--prompt-id", pid)
    assert svd.exit_code == 1 and f"missing file {rel}" in svd.output and "sigma" not in svd.output
    verify = invoke("store", "verify", full.path)
    assert verify.exit_code == 1
    assert corrupt_lines(verify) == [f"CORRUPT {pid}: missing file {rel}"]
    assert "2 of 3 prompts ok" in verify.output


def test_a_chunk_deleted_after_the_prompt_was_opened_raises_instead_of_reading_zeros(full):
    pid = full.ids[1]
    prompt = open_store(full.path).get(pid)
    (full.path / "prompts" / pid / "token_ids" / "c" / "0").unlink()
    with pytest.raises(CorruptError, match=rf"Expected chunk token_ids/c/0 of prompt {pid} in .*Got none: the file "
                                           "is missing"):
        prompt.array("token_ids")
    (full.path / "prompts" / pid / "output" / "c" / "0").unlink()
    with pytest.raises(CorruptError, match="Expected chunk output/c/0"):
        prompt.array("output")


def _flip(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_chunk_is_an_error_on_read_never_numbers_or_a_bare_codec_error(full):
    """Opening checks sizes, not contents: a same-size change is caught by the chunk's crc32c as it is read,
    through whole reads (unsharded arrays, a whole shard) and byte-range reads (one inner chunk of a shard)."""
    pid = full.ids[2]
    folder = full.path / "prompts" / pid
    prompt = open_store(full.path).get(pid)
    _flip(folder / "token_ids" / "c" / "0")
    with pytest.raises(CorruptError, match=rf"Expected chunk token_ids/c/0 of prompt {pid} in .*to match its crc32c "
                                           "checksum. Got bytes that do not"):
        prompt.array("token_ids")
    shard = next(p for p in (folder / "jacobian" / "c").rglob("*") if p.is_file())
    key = shard.relative_to(folder).as_posix()
    _flip(shard, 0.1)  # inside the first inner chunk: both a whole read and a read of that chunk must fail
    with pytest.raises(CorruptError, match=rf"Expected chunk {key} of prompt {pid} .*crc32c"):
        np.asarray(prompt.jacobian(lazy=False))
    with pytest.raises(CorruptError, match=rf"Expected chunk {key} of prompt {pid} .*crc32c"):
        np.asarray(prompt.jacobian(lazy=True)[:1, :1].compute())
    svd = invoke("analyze", "svd", full.path, "--prompt-id", pid)
    assert svd.exit_code == 1 and "crc32c" in svd.output and "sigma" not in svd.output
    assert "Traceback" not in svd.output and "ValueError" not in svd.output
    verify = invoke("store", "verify", full.path)
    assert verify.exit_code == 1 and len(corrupt_lines(verify)) == 1


@pytest.mark.parametrize("array", ["token_ids", "token_S", "token_U", "combined_U", "combined_S"])
def test_deleted_small_and_low_rank_arrays_are_reported(low, array):
    pid = low.ids[0]
    chunk = next(p for p in (low.path / "prompts" / pid / array).rglob("*") if p.is_file() and p.name != "zarr.json")
    rel = chunk.relative_to(low.path / "prompts" / pid).as_posix()
    chunk.unlink()
    verify = invoke("store", "verify", low.path)
    assert verify.exit_code == 1 and corrupt_lines(verify) == [f"CORRUPT {pid}: missing file {rel}"]
    reseal(low.path / "prompts" / pid)  # even with a seal that agrees, the absent chunk is no zeros
    verify = invoke("store", "verify", low.path)
    assert corrupt_lines(verify) == [f"CORRUPT {pid}: Expected chunk {rel} of prompt {pid} in {low.path}. Got none: "
                                     "the file is missing, so the data is damaged (`detjac store verify` lists "
                                     "everything that is)."]


# -- 2. verify decodes token ids and the model group ---------------------------------------------


def test_token_ids_that_disagree_with_the_attributes_are_reported(full):
    pid = full.ids[0]
    path = full.path / "prompts" / pid / "token_ids"
    ids = zarr.open_array(str(path), mode="r")[...]
    zarr.open_array(str(path), mode="r+")[...] = ids[::-1] + 1
    reseal(full.path / "prompts" / pid)
    verify = invoke("store", "verify", full.path)
    assert corrupt_lines(verify)[0] == (f"CORRUPT {pid}: the token_ids array differs from the token ids in the "
                                        "attributes")
    # the prompt was sealed again with other content: what was computed from the old one is not served either
    assert corrupt_lines(verify)[1:] == [f"CORRUPT analysis analysis/{pid}/svd_combined: analysis svd_combined of "
                                         f"{pid} was computed from other content than the prompt holds now; "
                                         "`detjac analyze` computes it again"]


def test_model_arrays_and_tokenizer_are_checked_against_their_sha256(full, tmp_path):
    copy = tmp_path / "copy.zarr"
    shutil.copytree(full.path, copy)
    zarr.open_array(str(copy / "model" / "unembedding"), mode="r+")[0, 0] += 1.0  # valid chunk, other bytes
    verify = invoke("store", "verify", copy)
    assert verify.exit_code == 1
    assert corrupt_lines(verify) == [f"CORRUPT model model/unembedding: Expected model/unembedding of {copy} to match "
                                     "the SHA-256 recorded when the store was created. Got different bytes: it was "
                                     "changed or damaged, and decoding with it would give wrong tokens."]
    svd = invoke("analyze", "svd", copy, "--prompt-id", full.ids[0])
    assert svd.exit_code == 1 and "Expected model/unembedding" in svd.output
    tok = zarr.open_array(str(full.path / "model" / "tokenizer"), mode="r+")
    data = tok[...]
    data[data == ord("a")] = ord("b")
    tok[...] = data
    verify = invoke("store", "verify", full.path)
    assert corrupt_lines(verify) == [f"CORRUPT model model/tokenizer.json: Expected model/tokenizer.json of "
                                     f"{full.path} to match the SHA-256 recorded when the store was created. Got "
                                     "different bytes: it was changed or damaged, and decoding with it would give "
                                     "wrong tokens."]
    for chunk in [p for p in (copy / "model" / "embedding").rglob("*") if p.is_file() and p.name != "zarr.json"]:
        chunk.unlink()
    assert any(line.startswith("CORRUPT model model/embedding: Expected chunk embedding/c/0/0 of the model arrays")
               for line in corrupt_lines(invoke("store", "verify", copy)))


# -- 3. attributes are checksummed, typed, and do not set verify's bound ---------------------------


def _edit_attrs(folder: Path, **changes) -> None:
    meta_file = folder / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["attributes"].update(changes)
    meta_file.write_text(json.dumps(meta))


def test_a_one_byte_change_to_a_prompt_s_text_is_noticed(full):
    pid = full.ids[2]
    text = open_store(full.path).get(pid).prompt
    _edit_attrs(full.path / "prompts" / pid, prompt=text[:-1] + chr(ord(text[-1]) ^ 1))
    verify = invoke("store", "verify", full.path)
    assert verify.exit_code == 1 and corrupt_lines(verify) == [
        f"CORRUPT {pid}: attributes changed since commit (their SHA-256 differs from the one written then)"]
    ls = invoke("store", "ls", full.path)
    assert ls.exit_code == 0 and f"{pid}  DAMAGED: attributes changed since commit" in ls.output
    assert len(ls.output.splitlines()) == 3
    info = invoke("store", "info", full.path)
    assert "3 complete prompts" in info.output and "1 of them DAMAGED" in info.output
    one = invoke("store", "info", full.path, pid)
    assert one.exit_code == 1 and "Got a damaged one: attributes changed since commit" in one.output


def test_a_changed_root_attribute_makes_the_store_unreadable(full):
    meta_file = full.path / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["attributes"]["detjac_store"]["run"]["model_id"] += "x"
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(StoreFormatError, match="Expected the root attributes of .* to match the SHA-256 written with "
                                               "them. Got a different one: the store's run description was changed"):
        open_store(full.path)
    assert invoke("store", "verify", full.path).exit_code == 1


@pytest.mark.parametrize("version", [True, 0, "2", 1.5, None])
def test_a_format_version_that_is_no_positive_integer_is_refused(full, version):
    meta_file = full.path / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["attributes"]["detjac_store"]["format_version"] = version
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(StoreFormatError, match=rf"Expected the store format version \(a positive integer\) in "
                                               rf".*Got {version!r}: the root attributes are damaged"):
        open_store(full.path)


@pytest.mark.parametrize("changes", [{"reconstruction_error": 0.5}, {"dtype": "bfloat16"}])
def test_attributes_do_not_widen_verify_s_bound(full, changes):
    pid = full.ids[0]
    folder = full.path / "prompts" / pid
    out = zarr.open_array(str(folder / "output"), mode="r+")
    out[...] = out[...] * 1.01  # 1 % corruption of the output
    _edit_attrs(folder, **changes)
    reseal(folder)  # as if the damage had been sealed too: the bound still comes from the run
    verify = invoke("store", "verify", full.path)
    line, *stale = corrupt_lines(verify)  # and the analysis result computed from the content before the reseal
    assert [s.split(": ", 1)[0] for s in stale] == [f"CORRUPT analysis analysis/{pid}/svd_combined"]
    assert line.startswith(f"CORRUPT {pid}: reconstruction error 9.9") and line.endswith(
        "above 1.0e-09 (the bound of float64)")


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("reconstruction_error", "abc", "a finite number >= 0 or null"),
    ("dtype", ["x"], "one of float64, float32, float16, bfloat16"),
    ("n_tokens", True, "a positive integer"),
    ("token_ids", [1, "2"], "a list of integers"),
])
def test_a_malformed_attribute_marks_only_that_prompt_corrupt(full, key, value, expected):
    pid = full.ids[1]
    _edit_attrs(full.path / "prompts" / pid, **{key: value})
    verify = invoke("store", "verify", full.path)
    assert verify.exit_code == 1 and verify.exception is None or isinstance(verify.exception, SystemExit)
    assert corrupt_lines(verify) == [f"CORRUPT {pid}: attribute {key!r} is {value!r}, expected {expected}"]
    assert "2 of 3 prompts ok" in verify.output and "Traceback" not in verify.output
    ls = invoke("store", "ls", full.path)
    assert ls.exit_code == 0 and f"{pid}  DAMAGED: attribute {key!r} is {value!r}" in ls.output


# -- 4. nothing read or written outside the store -----------------------------------------------


@pytest.mark.parametrize("bad", ["../../victim", "../prompts/x", "/etc", "0123456789ABCDEF", "0" * 17, ""])
def test_prompt_ids_from_the_command_line_never_become_paths(full, tmp_path, bad):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    before = snapshot(tmp_path, skip=full.path)
    expected = f"Expected a prompt id of 16 hex digits (as `detjac store ls` lists them). Got {bad!r}."
    for args in (("analyze", "svd", full.path, "--prompt-id", bad), ("store", "info", full.path, bad),
                 ("store", "export", full.path, bad, "--out", tmp_path / "x.npz")):
        result = invoke(*args)
        assert result.exit_code == 1 and expected in result.output, (args, result.output)
    assert snapshot(tmp_path, skip=full.path) == before
    with pytest.raises(InvalidArgumentError, match="Expected a prompt id of 16 hex digits"):
        open_store(full.path).write_analysis(bad, "svd_combined", {}, {})
    with pytest.raises(InvalidArgumentError, match="Expected an analysis result name made of letters"):
        open_store(full.path).write_analysis(full.ids[0], "../../escape", {}, {})


def test_a_symlinked_analysis_folder_is_refused_and_reported(full, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(full.path / "analysis", elsewhere)
    os.symlink(elsewhere, full.path / "analysis")
    before = snapshot(tmp_path, skip=full.path)
    result = invoke("analyze", "svd", full.path, "--prompt-id", full.ids[0], "--k", "1")
    assert result.exit_code == 1
    assert f"Expected no symlinks inside the store {full.path}. Got {full.path / 'analysis'} -> {elsewhere}" \
        in result.output
    assert snapshot(tmp_path, skip=full.path) == before
    verify = invoke("store", "verify", full.path)
    assert f"CORRUPT store analysis: a symlink (to {elsewhere}); symlinks inside a store are refused" \
        in verify.output


def test_a_symlinked_chunk_is_refused(full, tmp_path):
    pid = full.ids[0]
    chunk = full.path / "prompts" / pid / "embeddings" / "c" / "0" / "0"
    outside = tmp_path / "outside"
    shutil.copy(chunk, outside)
    chunk.unlink()
    os.symlink(outside, chunk)
    with pytest.raises(CorruptError, match="symlinks inside the store are refused: embeddings/c/0/0"):
        open_store(full.path).get(pid)
    assert "CORRUPT store prompts/" in invoke("store", "verify", full.path).output


# -- 5. --force-new replaces crash-safely; a refused run leaves no store ---------------------------


KILL_AFTER_ASIDE = """
import os
from detjac.store.backend import zarr_create
zarr_create.fsync_dir = lambda *a: os.kill(os.getpid(), 9)  # right after the old store is renamed aside
zarr_create.create_store({path!r}, {{"model_id": "other", "dtype": "float64", "keep": "full"}}, force_new=True)
"""


def test_a_kill_during_force_new_leaves_the_old_store_whole_and_the_next_writer_puts_it_back(full, tmp_path):
    script = KILL_AFTER_ASIDE.format(path=str(full.path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9
    assert not full.path.exists()  # renamed aside whole, never half-deleted in place
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".s.zarr.replaced-")]
    assert len(aside) == 1 and sorted(p.name for p in (aside[0] / "prompts").iterdir() if p.is_dir()) == full.ids
    with create_store(full.path, {"model_id": "other", "dtype": "float64", "keep": "full"}, force_new=True) as store:
        assert store.prompt_ids() == [] and store.fresh and store.restored_earlier == aside[0]
    assert open_store(full.path).prompt_ids() == full.ids  # the new run stored nothing: the old store is back
    assert not any(p.name.startswith(".s.zarr.") for p in tmp_path.iterdir())  # nothing left aside


def test_force_new_replaces_a_store_an_older_version_left_half_deleted(full):
    (full.path / "zarr.json").unlink()
    shutil.rmtree(full.path / "model")
    with pytest.raises(StoreFormatError, match="Got a folder without zarr.json"):
        create_store(full.path, full.run)
    with create_store(full.path, full.run, force_new=True) as store:
        assert store.prompt_ids() == []


def test_a_folder_that_is_not_a_store_is_never_replaced(tmp_path):
    folder = tmp_path / "photos"
    (folder / "prompts").mkdir(parents=True)
    (folder / "cat.jpg").write_bytes(b"jpeg")
    with pytest.raises(StoreFormatError, match="Got a folder without zarr.json"):
        create_store(folder, {"model_id": "m"}, force_new=True)
    assert (folder / "cat.jpg").read_bytes() == b"jpeg"


def test_a_store_created_and_left_empty_is_discarded_and_a_used_one_is_kept(tmp_path):
    path = tmp_path / "new.zarr"
    store = create_store(path, {"model_id": "m", "dtype": "float64", "keep": "full"})
    store.discard()
    assert not path.exists() and list(tmp_path.iterdir()) == []
    made = make_store(tmp_path / "used.zarr", prompts=1)
    with create_store(made.path, made.run) as resumed:
        resumed.discard()  # not created by this handle: kept
    assert open_store(made.path).prompt_ids() == made.ids


# -- 6. the store is a zarr hierarchy --------------------------------------------------------------


def test_the_whole_store_walks_as_a_zarr_hierarchy_without_warnings(full):
    full.open().get(full.ids[0])
    with create_store(full.path, full.run) as store:  # held: the writer group holds the holder record
        store.record_failure("f" * 16, {"prompt": "x", "line": 9, "reason": "r", "error": "PromptError",
                                         "stage": "tokenize"})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            members = dict(zarr.open_group(str(full.path), mode="r").members(max_depth=None))
    assert "analysis" in members and f"analysis/{full.ids[0]}/svd_combined" in members
    assert "_writer" in members and "holder" in members["_writer"].attrs
    assert "model/tokenizer" in members and f"failed/{'f' * 16}" in members


# -- older stores -----------------------------------------------------------------------------------


def test_format_1_stores_stay_readable_and_verified_as_far_as_they_can_be(tmp_path):
    copy = tmp_path / "full.zarr"
    shutil.copytree(FORMAT1 / "full.zarr", copy)
    store = open_store(copy)
    assert store.format_version == 1 and len(store) == 2
    for prompt in store:
        J, x, y = prompt.jacobian(lazy=False), prompt.array("embeddings"), prompt.array("output")
        assert np.linalg.norm(np.einsum("rtc,tc->r", J, x) - y) < 1e-12 * np.linalg.norm(y)
        assert prompt.layerwise_targets == ["layer.0", "mlp_local.1"]
    assert store.read_analysis(store.prompt_ids()[0], "svd_combined")[0]["S"].tolist() == [2.0, 1.0]
    assert store.model_bytes("tokenizer.json").startswith(b"{")
    verify = invoke("store", "verify", copy)
    assert verify.exit_code == 0 and "2 of 2 prompts ok" in verify.output
    assert "note: a format-1 store has no checksums of its attributes and files" in verify.output
    low = invoke("store", "verify", FORMAT1 / "lowrank.zarr")
    assert low.exit_code == 0 and "1 of 1 prompts ok" in low.output
    (copy / "prompts" / store.prompt_ids()[0] / "jacobian" / "c" / "0" / "0" / "0").unlink()
    with pytest.raises(CorruptError, match="Expected chunk jacobian/c/0/0/0"):
        store.get(store.prompt_ids()[0]).jacobian(lazy=False)
    with pytest.raises(StoreError, match=r"format_version: 1 \(store\) != 2: stores of an older format are read, "
                                         "not extended"):
        create_store(copy, store.run)


def test_a_prompts_attributes_are_checked_as_opening_it_checks_them(full):
    """``prompt_attrs`` (the corpus of ``detjac view``) reads only the attributes: a change to them is refused as
    ``get`` refuses it; a missing file is left to opening the prompt."""
    pid, other = full.ids[0], full.ids[1]
    assert open_store(full.path).prompt_attrs(pid) == open_store(full.path).get(pid).attrs
    text = open_store(full.path).get(other).prompt
    _edit_attrs(full.path / "prompts" / pid, prompt="another text")
    with pytest.raises(CorruptError, match=rf"Expected an intact prompt {pid} in .*Got a damaged one: attributes "
                                           "changed since commit"):
        open_store(full.path).prompt_attrs(pid)
    (full.path / "prompts" / other / "output" / "c" / "0").unlink()
    assert open_store(full.path).prompt_attrs(other)["prompt"] == text
    with pytest.raises(CorruptError, match=r"missing file output/c/0"):
        open_store(full.path).get(other)
