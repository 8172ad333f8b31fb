"""`detjac run` into a store and the store commands: round trip, resume, verify, bad input."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from store_helpers import PROMPTS, assert_all_equal, reseal, store_snapshot, write_prompts

from detjac.cli.main import main
from detjac.engine import InMemoryEngine, jacobian, load_model
from detjac.engine.checkpoints.tiny import tiny_model_types
from detjac.store import open_store


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def run_store(tmp_path_factory):
    """A store of the default model on 4 prompts (plus a blank line and a duplicate)."""
    folder = tmp_path_factory.mktemp("run")
    prompts = write_prompts(folder / "p.txt", [PROMPTS[0], "", PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3]])
    result = invoke("run", "default", str(prompts), "--out", str(folder / "s.zarr"), "--row-block", "48")
    assert result.exit_code == 0, result.output
    return folder / "s.zarr", prompts, result.output


def test_round_trip_is_bit_for_bit(run_store):
    path, _, out = run_store
    assert "5 prompts in" in out and "1 blank lines skipped, 1 duplicates" in out and "4 written" in out
    store = open_store(path)
    model = load_model("default")
    assert len(store) == 4
    for prompt in store:
        res = jacobian(InMemoryEngine(model), prompt.prompt, row_block=48)
        assert_all_equal(prompt.jacobian(lazy=False), res.jacobian.numpy())
        assert_all_equal(prompt.array("embeddings"), res.embeddings.numpy())
        assert_all_equal(prompt.array("output"), res.output.numpy())
        assert prompt.array("token_ids").tolist() == res.token_ids == prompt.attrs["token_ids"]
        assert prompt.attrs["reconstruction_error"] < 1e-12
        assert prompt.attrs["next_token_id"] == res.next_token_id
        assert_all_equal(prompt.operator(-1), res.operator(len(res.token_ids) - 1).numpy())


def test_store_metadata_and_lazy_readers(run_store):
    path, _, _ = run_store
    store = open_store(path)
    assert store.run["model_id"] == "gcide-llama" and store.run["dtype"] == "float64"
    assert store.run["model_type"] == "llama" and store.run["detach_rules"]
    prompt = store.prompts(contains="Oak")[0]
    for key in ("prompt", "tokens", "token_ids", "reconstruction_error", "detjac_version", "written_at",
                "detach_rules", "model_id", "dtype"):
        assert key in prompt.attrs, key
    lazy = prompt.jacobian()
    assert lazy.chunksize[0] == 48 and lazy.shape == (256, prompt.n_tokens, 256)
    import xarray as xr

    ds = xr.open_zarr(str(path / "prompts" / prompt.id), consolidated=False)
    assert ds["jacobian"].dims == ("row", "token", "col") and ds["embeddings"].dims == ("token", "col")
    x, y = ds["embeddings"].values, ds["output"].values
    recon = np.einsum("rtc,tc->r", ds["jacobian"].values, x)
    assert np.linalg.norm(recon - y) / np.linalg.norm(y) < 1e-12
    assert [p.id for p in store.prompts(where=lambda a: a["n_tokens"] > 100)] == []


def test_rerun_skips_complete_prompts_and_changes_nothing(run_store):
    path, prompts, _ = run_store
    before = store_snapshot(path)
    result = invoke("run", "default", str(prompts), "--out", str(path), "--row-block", "48")
    assert result.exit_code == 0, result.output
    assert "4 already in" in result.output and "0 written" in result.output
    assert store_snapshot(path) == before


def test_store_commands(run_store, tmp_path):
    path, _, _ = run_store
    ls = invoke("store", "ls", str(path), "--contains", "Kitten")
    assert ls.exit_code == 0 and len(ls.output.strip().splitlines()) == 1 and "Kitten" in ls.output
    pid = ls.output.split()[0]
    info = invoke("store", "info", str(path))
    assert "4 complete prompts" in info.output and "format version 2" in info.output
    one = invoke("store", "info", str(path), pid)
    assert json.loads(one.output[: one.output.rindex("}") + 1])["prompt"] == PROMPTS[0]
    verify = invoke("store", "verify", str(path))
    assert verify.exit_code == 0 and "4 of 4 prompts ok" in verify.output
    npz = tmp_path / "one.npz"
    assert invoke("store", "export", str(path), pid, "--out", str(npz)).exit_code == 0
    data = np.load(npz, allow_pickle=False)
    assert_all_equal(data["jacobian"], open_store(path).get(pid).jacobian(lazy=False))
    assert json.loads(str(data["attrs"]))["prompt"] == PROMPTS[0]


def test_verify_flags_a_corrupted_chunk_by_id(run_store, tmp_path):
    import shutil

    copy = tmp_path / "copy.zarr"
    shutil.copytree(run_store[0], copy)
    victim = open_store(copy).prompt_ids()[1]
    chunk = next((copy / "prompts" / victim / "jacobian").rglob("c/*/*/*"))
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 3] ^= 0x40  # one flipped bit in the compressed payload
    chunk.write_bytes(bytes(raw))
    result = invoke("store", "verify", str(copy))
    assert result.exit_code == 1
    rel = chunk.relative_to(copy / "prompts" / victim).as_posix()
    assert f"CORRUPT {victim}: file {rel} changed since commit (its SHA-256 differs)" in result.output
    assert "3 of 4 prompts ok" in result.output and "1 corrupt" in result.output
    reseal(copy / "prompts" / victim)  # behind the seal, the chunk's crc32c catches the flipped bit
    assert f"CORRUPT {victim}: chunk {rel} fails its crc32c checksum\n" in invoke("store", "verify", str(copy)).output


def test_float32_run_and_dtype_mismatch_on_resume(tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:2])
    out = tmp_path / "s.zarr"
    assert invoke("run", "default", str(prompts), "--out", str(out), "--dtype", "float32").exit_code == 0
    store = open_store(out)
    prompt = store.get(store.prompt_ids()[0])
    assert prompt.jacobian().dtype == np.float32 and prompt.attrs["reconstruction_error"] < 1e-5
    before = store_snapshot(out)
    result = invoke("run", "default", str(prompts), "--out", str(out))
    assert result.exit_code == 1
    assert "Expected the store" in result.output and "dtype: 'float32' (store) != 'float64'" in result.output
    assert "--force-new" in result.output and store_snapshot(out) == before
    forced = invoke("run", "default", str(prompts), "--out", str(out), "--force-new")
    assert forced.exit_code == 0, forced.output
    assert open_store(out).run["dtype"] == "float64" and len(open_store(out)) == 2


def test_force_new_keeps_the_old_store_when_the_new_run_stores_no_prompt(tmp_path):
    """A --force-new run whose every prompt fails (a NaN weight: reconstruction error nan) gives the old store back
    unchanged; the next --force-new run that stores a prompt replaces it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from detjac.engine.checkpoints.default import resolve_model

    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:2])
    out = tmp_path / "s.zarr"
    assert invoke("run", "default", str(prompts), "--out", str(out)).exit_code == 0
    before = store_snapshot(out)
    broken = shutil.copytree(resolve_model("default"), tmp_path / "nan-model")
    (weights,) = broken.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    failed = invoke("run", str(broken), str(prompts), "--out", str(out), "--force-new")
    assert failed.exit_code == 1 and "reconstruction error nan" in failed.output, failed.output
    assert "the store --force-new replaced is back" in failed.output and store_snapshot(out) == before
    assert not list(tmp_path.glob(".s.zarr.*"))
    forced = invoke("run", "default", str(prompts), "--out", str(out), "--force-new", "--dtype", "float32")
    assert forced.exit_code == 0 and open_store(out).run["dtype"] == "float32" and not list(tmp_path.glob(".s.zarr.*"))


def test_bfloat16_results_are_stored_as_float32(tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:1])
    result = invoke("run", "default", str(prompts), "--out", str(tmp_path / "s.zarr"), "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    prompt = next(iter(open_store(tmp_path / "s.zarr")))
    assert prompt.attrs["dtype"] == "bfloat16" and prompt.attrs["storage_dtype"] == "float32"
    assert prompt.jacobian(lazy=False).dtype == np.float32
    assert torch.isfinite(torch.tensor(prompt.attrs["reconstruction_error"]))


@pytest.mark.parametrize("model_type", tiny_model_types())
def test_run_works_for_every_family(tmp_path, model_type):
    from detjac.engine.checkpoints.tiny import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / model_type, model_type)
    prompts = write_prompts(tmp_path / "p.txt", ["The fog rolls over the bay and", "A second prompt"])
    result = invoke("run", str(checkpoint), str(prompts), "--out", str(tmp_path / "s.zarr"), "--row-block", "8")
    assert result.exit_code == 0, result.output
    store = open_store(tmp_path / "s.zarr")
    assert store.run["model_type"] == model_type and len(store) == 2
    assert all(p.attrs["reconstruction_error"] < 1e-12 for p in store) and all(r.ok for r in store.verify())
    assert store.model_array("embedding").shape[0] == store.model_array("unembedding").shape[0]


@pytest.mark.parametrize("keep", ["full", "rank:4"])
def test_affine_run_stores_the_offset_and_verify_checks_it(tmp_path, keep):
    import zarr

    from detjac.engine.checkpoints.tiny import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "gpt2", "gpt2")
    prompts = write_prompts(tmp_path / "p.txt", ["The fog rolls over the bay and"])
    result = invoke("run", str(checkpoint), str(prompts), "--out", str(tmp_path / "s.zarr"), "--keep", keep)
    assert result.exit_code == 0, result.output
    prompt = next(iter(open_store(tmp_path / "s.zarr")))
    bias = prompt.bias()
    assert prompt.attrs["affine"] is True and bias.shape == prompt.array("output").shape
    assert prompt.attrs["reconstruction_error"] < 1e-12
    if keep != "full":
        return
    jac, x = prompt.jacobian(lazy=False), prompt.array("embeddings")
    assert np.allclose(np.einsum("rtc,tc->r", jac, x) + bias, prompt.array("output"), rtol=0, atol=1e-12)
    assert invoke("store", "verify", str(tmp_path / "s.zarr")).exit_code == 0
    folder = tmp_path / "s.zarr" / "prompts" / prompt.id
    zarr.open_array(str(folder / "bias"), mode="r+")[...] = bias + 1.0  # a wrong offset, every chunk written
    verify = invoke("store", "verify", str(tmp_path / "s.zarr"))
    assert verify.exit_code == 1 and f"CORRUPT {prompt.id}: file bias/c/0 changed since commit" in verify.output
    reseal(folder)  # behind the seal, the reconstruction y = J x + b catches the wrong offset
    verify = invoke("store", "verify", str(tmp_path / "s.zarr"))
    assert verify.exit_code == 1 and re.search(rf"CORRUPT {prompt.id}: reconstruction error \S+ above", verify.output)


def test_linear_family_stores_no_offset(tmp_path):
    from detjac.engine.checkpoints.tiny import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "llama", "llama")
    prompts = write_prompts(tmp_path / "p.txt", ["The fog rolls over the bay and"])
    assert invoke("run", str(checkpoint), str(prompts), "--out", str(tmp_path / "s.zarr")).exit_code == 0
    prompt = next(iter(open_store(tmp_path / "s.zarr")))
    assert prompt.bias() is None and "affine" not in prompt.attrs


def test_streamed_run_of_an_affine_model_is_refused_cleanly(tmp_path):
    from detjac.engine.checkpoints.tiny import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "bert", "bert")
    prompts = write_prompts(tmp_path / "p.txt", ["The fog rolls over the bay and"])
    result = invoke("run", str(checkpoint), str(prompts), "--out", str(tmp_path / "s.zarr"), "--streamed")
    assert result.exit_code == 1 and "layer-streamed engine" in result.output and "BERT" in result.output
    assert not (tmp_path / "s.zarr").exists()


# Whole `detjac run`s on the default model or a cluster: seconds each.
pytestmark = pytest.mark.slow
