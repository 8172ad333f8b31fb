"""A model path that does not exist: a name that looks like a mistyped GGUF file is told to be one."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.engine.checkpoints.gguf import looks_like_gguf
from detjac.engine.checkpoints.loading import read_checkpoint
from detjac.errors import CheckpointError


@pytest.mark.parametrize("name", ["model.ggfu", "model.guf", "model.GGUFF", "m.gufff", "m.ugfg"])
def test_a_mistyped_gguf_name_is_told_to_be_a_gguf_file(tmp_path, name):
    with pytest.raises(CheckpointError, match=r"Expected a GGUF file \(\*\.gguf\), a Hugging Face checkpoint"):
        read_checkpoint(tmp_path / name)
    prompts = tmp_path / "p.txt"
    prompts.write_text("Oak, n. A\n")
    out = CliRunner().invoke(main, ["run", str(tmp_path / name), str(prompts), "--out", str(tmp_path / "s.zarr")])
    assert out.exit_code == 1 and out.output.count("\n") == 1, out.output
    assert "a GGUF file" in out.output and "ends in .gguf" in out.output


@pytest.mark.parametrize("name", ["no-such-folder", "model.gif", "model.bin", "weights.safetensors"])
def test_other_missing_names_are_not_called_gguf_files(tmp_path, name):
    assert not looks_like_gguf(name)
    with pytest.raises(CheckpointError, match="Expected a Hugging Face checkpoint directory or a hub id") as got:
        read_checkpoint(tmp_path / name)
    assert "GGUF" not in str(got.value)
