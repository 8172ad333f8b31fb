"""A store knows its weights: the run identity holds the weight files' SHA-256s (the hub's where its cache
has them, else hashed once and cached), resuming after the weights changed is refused naming the file, and
a checkpoint with a tensor missing or unexpected is refused before anything is written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hub_cache import fabricate_hub_cache
from safetensors.torch import load_file, save_file
from store_helpers import write_prompts

from detjac.engine import load_engine, load_model
from detjac.engine.checkpoints.default import DEFAULT_MODEL_DIR
from detjac.errors import CheckpointError, StoreMismatchError
from detjac.model_settings import LoadSpec
from detjac.runs.fingerprint import DigestCache, combined_digest, content_sample, weights_fingerprint
from detjac.runs.run import RunOptions, run_corpus
from detjac.store import open_store

WEIGHTS = "model.safetensors"


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_weights(folder: Path, change) -> None:
    tensors = load_file(folder / WEIGHTS)
    change(tensors)
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})


def test_hub_files_are_named_by_their_blob_and_others_hashed_once(tmp_path: Path) -> None:
    truth = hashlib.sha256((DEFAULT_MODEL_DIR / WEIGHTS).read_bytes()).hexdigest()
    snapshot = fabricate_hub_cache(tmp_path / "hub", "org/name", DEFAULT_MODEL_DIR)
    cache = DigestCache(tmp_path / "digests")
    assert weights_fingerprint(snapshot, cache) == {WEIGHTS: truth}
    assert cache.hashed == []  # the hub's blob name is the SHA-256: nothing was read

    folder = copy_checkpoint(DEFAULT_MODEL_DIR, tmp_path / "plain")
    first = DigestCache(tmp_path / "digests")
    assert weights_fingerprint(folder, first) == {WEIGHTS: truth} and first.hashed == [folder / WEIGHTS]
    again = DigestCache(tmp_path / "digests")  # a new process: the digest comes from the cache file
    assert weights_fingerprint(folder, again) == {WEIGHTS: truth} and again.hashed == []
    st = (folder / WEIGHTS).stat()
    os.utime(folder / WEIGHTS, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: hashed again
    touched = DigestCache(tmp_path / "digests")
    assert weights_fingerprint(folder, touched) == {WEIGHTS: truth} and touched.hashed == [folder / WEIGHTS]


def rewrite_in_place(path: Path, offset: int, data: bytes) -> None:
    """Overwrite bytes without changing the file's size, then put its access and modification times back."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_weights_rewritten_in_place_with_their_old_size_and_time_are_hashed_again(tmp_path: Path) -> None:
    folder = copy_checkpoint(DEFAULT_MODEL_DIR, tmp_path / "plain")
    path = folder / WEIGHTS
    truth = hashlib.sha256(path.read_bytes()).hexdigest()
    assert weights_fingerprint(folder, DigestCache(tmp_path / "digests")) == {WEIGHTS: truth}
    rewrite_in_place(path, path.stat().st_size // 3, b"\x7f" * 64)
    cache = DigestCache(tmp_path / "digests")
    changed = hashlib.sha256(path.read_bytes()).hexdigest()
    assert changed != truth and weights_fingerprint(folder, cache) == {WEIGHTS: changed} and cache.hashed == [path]


def test_where_status_times_say_nothing_a_content_sample_still_catches_a_rewritten_tensor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system whose ctime and inode cannot be trusted (the cache sees size and mtime only): the cached digest
    is still checked against a content sample, which covers every tensor's first and last 4 KiB."""
    monkeypatch.setattr(DigestCache, "_stamp", staticmethod(lambda p: {"size": p.stat().st_size,
                                                                        "mtime_ns": p.stat().st_mtime_ns}))
    folder = copy_checkpoint(DEFAULT_MODEL_DIR, tmp_path / "plain")
    path = folder / WEIGHTS
    weights_fingerprint(folder, DigestCache(tmp_path / "digests"))
    n = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + n])
    start, end = header["model.norm.weight"]["data_offsets"]  # a small tensor between two samples
    sample = content_sample(path)
    rewrite_in_place(path, 8 + n + start, bytes(end - start))
    assert content_sample(path) != sample
    cache = DigestCache(tmp_path / "digests")
    assert weights_fingerprint(folder, cache) == {WEIGHTS: hashlib.sha256(path.read_bytes()).hexdigest()}
    assert cache.hashed == [path]


def test_resume_after_the_tokenizer_changed_is_refused_naming_the_file(tmp_path: Path) -> None:
    folder = copy_checkpoint(DEFAULT_MODEL_DIR, tmp_path / "model")
    prompts = write_prompts(tmp_path / "p.txt", ["Oak tree"])
    out = str(tmp_path / "run.zarr")
    run_corpus(str(folder), prompts, out, RunOptions())
    run = open_store(out).run
    old = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    assert run["tokenizer"]["tokenizer.json"] == old and run["tokenizer_sha256"] == combined_digest(run["tokenizer"])
    assert run_corpus(str(folder), prompts, out, RunOptions()).summary.skipped_complete == 1

    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}  # another tokenizer: "Oak" and "oak" are now one token
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(StoreMismatchError, match=f"tokenizer_sha256: .*Tokenizer files that differ: tokenizer.json: "
                                                 f"sha256 {old[:16]}\\.\\.\\. \\(store\\) != sha256 "):
        run_corpus(str(folder), prompts, out, RunOptions())
    assert len(open_store(out)) == 1 and open_store(out).run["tokenizer_sha256"] == run["tokenizer_sha256"]


def test_resume_after_the_weights_changed_is_refused_naming_the_file(tmp_path: Path, llama_checkpoint: Path) -> None:
    folder = copy_checkpoint(llama_checkpoint, tmp_path / "model")
    prompts = write_prompts(tmp_path / "p.txt", ["a b c"])
    out = str(tmp_path / "run.zarr")
    run_corpus(str(folder), prompts, out, RunOptions())
    run = open_store(out).run
    digest = hashlib.sha256((folder / WEIGHTS).read_bytes()).hexdigest()
    assert run["weights"] == {WEIGHTS: digest} and run["weights_sha256"] == combined_digest({WEIGHTS: digest})
    assert run_corpus(str(folder), prompts, out, RunOptions()).summary.skipped_complete == 1  # same weights: resumed

    rewrite_weights(folder, lambda t: t["model.norm.weight"].mul_(1.5))
    with pytest.raises(StoreMismatchError, match=f"Weight files that differ: {WEIGHTS}: sha256 {digest[:16]}"
                                                 "\\.\\.\\. \\(store\\) != sha256 "):
        run_corpus(str(folder), prompts, out, RunOptions())
    outcome = run_corpus(str(folder), prompts, out, RunOptions(force_new=True))
    assert outcome.summary.written == 1 and open_store(out).run["weights"][WEIGHTS] != digest


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize(("what", "change"), [
    ("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
    ("unexpected", lambda t: t.__setitem__("model.layers.1.mlp.extra.weight", torch.zeros(3))),
])
def test_a_checkpoint_missing_a_tensor_or_with_an_extra_one_is_refused(tmp_path: Path, streamed: bool, what: str,
                                                                       change) -> None:
    folder = copy_checkpoint(DEFAULT_MODEL_DIR, tmp_path / "model")
    rewrite_weights(folder, change)
    name = "model.layers.1.mlp.up_proj.weight" if what == "missing" else "model.layers.1.mlp.extra.weight"
    with pytest.raises(CheckpointError, match=f"Got 1 {what}: {name}"):
        load_engine(folder, streamed=streamed)
    out = tmp_path / "run.zarr"
    with pytest.raises(CheckpointError):
        run_corpus(str(folder), write_prompts(tmp_path / "p.txt", ["Oak"]), str(out),
                   RunOptions(load=LoadSpec(streamed=streamed)))
    assert not out.exists()  # refused before a store was created


def test_the_shipped_model_and_tied_checkpoints_load_complete() -> None:
    assert load_model(DEFAULT_MODEL_DIR) is not None  # tied unembedding: lm_head.weight is not in the file
    assert load_engine(DEFAULT_MODEL_DIR, streamed=True).n_layers == 4


def test_a_run_on_a_hub_id_records_the_id_the_snapshot_and_the_hubs_hashes(tmp_path: Path, llama_checkpoint: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = fabricate_hub_cache(tmp_path / "hub", "org/tiny-llama", llama_checkpoint)
    out = str(tmp_path / "run.zarr")
    run_corpus("org/tiny-llama", write_prompts(tmp_path / "p.txt", ["a b c"]), out, RunOptions())
    run = open_store(out).run
    assert run["model_id"] == "org/tiny-llama" and run["model_path"] == str(snapshot)
    blob = Path(os.readlink(snapshot / WEIGHTS)).name
    assert run["weights"] == {WEIGHTS: blob} == {WEIGHTS: hashlib.sha256((llama_checkpoint / WEIGHTS).read_bytes())
                                                 .hexdigest()}
