"""`detjac store ls|info|verify|export` on synthetic stores: listings, a flipped bit found, low-rank prompts exported.

The same commands on stores of a real run are in tests/runs/test_store_run.py.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import zarr
from click.testing import CliRunner
from store_helpers import reseal

from detjac.cli.main import main
from detjac.store.testing import make_store


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("full") / "s.zarr", prompts=["the oak tree grows", "a young cat",
                                                                            "the harp plays in the sea"])


def test_ls_and_info(full):
    ls = invoke("store", "ls", full.path, "--contains", "cat")
    assert ls.exit_code == 0 and len(ls.output.strip().splitlines()) == 1
    pid = ls.output.split()[0]
    assert full.prompts[pid].text == "a young cat" and "3 tok" in ls.output
    info = invoke("store", "info", full.path)
    assert "3 complete prompts" in info.output and "format version 2" in info.output
    assert '"model_id": "synthetic"' in info.output
    one = invoke("store", "info", full.path, pid)
    attrs = json.loads(one.output[: one.output.rindex("}") + 1])
    assert attrs["prompt"] == "a young cat" and attrs["token_ids"] == full.prompts[pid].token_ids
    assert "jacobian (8, 3, 8) float64, chunks (3, 3, 8)" in one.output


def test_export_never_overwrites_without_force_and_a_failed_write_keeps_the_previous_file(full, tmp_path, monkeypatch):
    from detjac.store.summary import export_npz

    first, second = full.ids[0], full.ids[1]
    out = tmp_path / "one.npz"
    assert invoke("store", "export", full.path, first, "--out", out).exit_code == 0
    kept = out.read_bytes()
    again = invoke("store", "export", full.path, second, "--out", out)
    assert again.exit_code == 1 and "exists (--force replaces it)" in again.output and out.read_bytes() == kept
    (tmp_path / "folder.npz").mkdir()
    (tmp_path / "link.npz").symlink_to(out)
    for target in ("folder.npz", "link.npz"):
        refused = invoke("store", "export", full.path, second, "--out", tmp_path / target, "--force")
        assert refused.exit_code in (1, 2) and ("nothing was written" in refused.output
                                                or "is a directory" in refused.output), refused.output
    assert out.read_bytes() == kept

    def killed(handle, **arrays):  # the process dies half-way through writing the archive
        handle.write(b"PK\x03\x04 half an archive")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", killed)
    with pytest.raises(KeyboardInterrupt):
        export_npz(full.open(), second, out, force=True)
    assert out.read_bytes() == kept and sorted(p.name for p in tmp_path.iterdir()) == ["folder.npz", "link.npz",
                                                                                       "one.npz"]
    monkeypatch.undo()
    assert invoke("store", "export", full.path, second, "--out", out, "--force").exit_code == 0
    data = np.load(out, allow_pickle=False)
    assert np.array_equal(data["token_ids"], full.prompts[second].token_ids)
    assert invoke("store", "export", full.path, second, "--out", tmp_path / "bare").output.strip().endswith(
        "bare.npz")


def test_export_writes_every_array(full, tmp_path):
    pid = full.ids[0]
    assert invoke("store", "export", full.path, pid, "--out", tmp_path / "one.npz").exit_code == 0
    data = np.load(tmp_path / "one.npz", allow_pickle=False)
    truth = full.prompts[pid]
    assert np.array_equal(data["jacobian"], truth.jacobian) and np.array_equal(data["embeddings"], truth.embeddings)
    assert data["token_ids"].tolist() == truth.token_ids and "bias" not in data.files
    assert json.loads(str(data["attrs"]))["prompt"] == truth.text


def test_verify_flags_a_corrupted_chunk_by_id(full, tmp_path):
    assert "3 of 3 prompts ok" in invoke("store", "verify", full.path).output
    copy = tmp_path / "copy.zarr"
    shutil.copytree(full.path, copy)
    victim = full.ids[1]
    chunk = next((copy / "prompts" / victim / "jacobian").rglob("c/*/*/*"))
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 3] ^= 0x40  # one flipped bit in the compressed payload
    chunk.write_bytes(bytes(raw))
    result = invoke("store", "verify", copy)
    assert result.exit_code == 1
    rel = chunk.relative_to(copy / "prompts" / victim).as_posix()
    assert f"CORRUPT {victim}: file {rel} changed since commit (its SHA-256 differs)" in result.output
    assert "2 of 3 prompts ok" in result.output and "1 corrupt" in result.output
    reseal(copy / "prompts" / victim)  # behind the seal, the chunk's own crc32c still catches the flip
    result = invoke("store", "verify", copy)
    assert result.exit_code == 1 and f"CORRUPT {victim}: chunk {rel} fails its crc32c checksum\n" in result.output


def test_verify_checks_an_affine_prompt_s_offset(tmp_path):
    made = make_store(tmp_path / "s.zarr", prompts=1, affine=True)
    (pid,) = made.ids
    assert invoke("store", "verify", made.path).exit_code == 0
    data = tmp_path / "x.npz"
    assert invoke("store", "export", made.path, pid, "--out", data).exit_code == 0
    assert np.array_equal(np.load(data)["bias"], made.prompts[pid].bias)
    zarr.open_array(str(made.path / "prompts" / pid / "bias"), mode="r+")[...] = 0.5 * made.prompts[pid].bias
    reseal(made.path / "prompts" / pid)
    verify = invoke("store", "verify", made.path)
    assert verify.exit_code == 1 and f"CORRUPT {pid}: reconstruction error" in verify.output


def test_low_rank_prompts_in_info_export_and_verify(tmp_path):
    low = make_store(tmp_path / "low.zarr", prompts=2, keep="rank:3", n_tokens=5)
    verify = invoke("store", "verify", low.path)
    assert verify.exit_code == 0 and "2 of 2 prompts ok" in verify.output
    pid = low.ids[0]
    info = invoke("store", "info", low.path, pid)
    assert info.exit_code == 0 and "low rank: combined U (8, 3), S (3,), V (5, 8, 3)" in info.output
    assert invoke("store", "export", low.path, pid, "--out", tmp_path / "x.npz").exit_code == 0
    data = np.load(tmp_path / "x.npz", allow_pickle=False)
    assert "jacobian" not in data.files and data["token_U"].shape == (5, 8, 3)
    J = low.prompts[pid].jacobian
    np.testing.assert_allclose(data["combined_S"], np.linalg.svd(J.reshape(8, -1), compute_uv=False)[:3], rtol=1e-8)
    assert not (low.path / "prompts" / pid / "jacobian").exists()
    S = low.path / "prompts" / low.ids[1] / "token_S"
    zarr.open_array(str(S), mode="r+")[0, 0] = -1.0  # not a spectrum: verify says so
    reseal(S.parent)
    verify = invoke("store", "verify", low.path)
    assert verify.exit_code == 1
    assert f"CORRUPT {low.ids[1]}: token_S is not a valid descending spectrum" in verify.output
