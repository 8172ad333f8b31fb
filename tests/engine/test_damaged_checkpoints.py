"""Damaged or mistaken checkpoint folders give one clear line, before anything is allocated or written: a truncated
or malformed safetensors file, a tensor of another shape than the config says, an unreadable tokenizer, a config
size of the wrong type or beyond what the weights hold. Both engines."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from detjac.engine import load_engine
from detjac.engine.checkpoints.default import DEFAULT_MODEL_DIR
from detjac.errors import CheckpointError

WEIGHTS = "model.safetensors"


class _Call:
    def __reduce__(self):
        return (os.getcwd, ())


def damaged(tmp_path: Path, how: str) -> Path:
    folder = tmp_path / how
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    weights, config = folder / WEIGHTS, folder / "config.json"
    if how == "truncated":
        os.truncate(weights, weights.stat().st_size - 4096)
    elif how == "padded":
        with open(weights, "ab") as f:
            f.write(b"\0" * 16)
    elif how == "header":  # a header size larger than the file
        data = bytearray(weights.read_bytes())
        data[:8] = struct.pack("<Q", len(data) * 2)
        weights.write_bytes(bytes(data))
    elif how == "offsets":  # a tensor whose offsets do not span its shape's bytes
        data = bytearray(weights.read_bytes())
        n = struct.unpack("<Q", data[:8])[0]
        at = data.index(b'"model.norm.weight"', 8, 8 + n)
        shape = data.index(b'"shape":[256]', at)
        data[shape:shape + 13] = b'"shape":[257]'  # same length: only the shape changes
        weights.write_bytes(bytes(data))
    elif how == "shape":
        tensors = load_file(weights)
        key = "model.layers.1.mlp.up_proj.weight"
        tensors[key] = tensors[key][:-1].clone()
        save_file(tensors, weights, metadata={"format": "pt"})
    elif how == "pickle":  # a .bin whose pickle calls a function: refused by weights_only, never run
        weights.unlink()
        (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Call(), protocol=2))
    elif how == "tokenizer":
        (folder / "tokenizer.json").write_text('{"version": "1.0", "model": tru')
    else:
        key, value = how.split("=")
        spec = json.loads(config.read_text())
        spec[key] = json.loads(value)
        config.write_text(json.dumps(spec))
    return folder


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize(("how", "message"), [
    ("truncated", r"to hold \d+ bytes \(its header's tensors end there\)\. Got \d+: the file is truncated"),
    ("padded", r"Got \d+: the file is longer than its tensors"),
    ("header", r"Expected a readable safetensors file at .*model.safetensors\. Got: a header of \d+ bytes"),
    ("offsets", r"Expected model\.norm\.weight in .* to span \d+ bytes \(shape \(257,\), F32\)"),
    ("shape", r"Got 1 of another shape: model\.layers\.1\.mlp\.up_proj\.weight \(703, 256\) \(checkpoint\) != "
              r"\(704, 256\) \(config\)"),
    ("pickle", r"Expected weights that torch\.load\(weights_only=True\) reads in .*Got a pickled file that holds "
               r"other objects \(.*getcwd.*\); it was not loaded"),
    ("tokenizer", r"Expected a readable tokenizer in .*tokenizer \(tokenizer\.json, .*\)\. Got \w+Error: "),
    ('hidden_size="256"', r"Expected hidden_size in .*config\.json to be a positive integer\. Got '256' \(str\)"),
    ("num_hidden_layers=0", r"Expected num_hidden_layers in .* to be a positive integer\. Got 0 \(int\)"),
    ("num_attention_heads=true", r"Expected num_attention_heads .* positive integer\. Got True \(bool\)"),
    ("num_hidden_layers=400000000", r"Expected num_hidden_layers in .* to be at most the number of tensors in its "
                                    r"weights, \d+\. Got 400000000"),
    ("intermediate_size=100000000", r"Expected intermediate_size .* at most the largest dimension of its tensors"),
    ("max_position_embeddings=1000000000000", r"Expected max_position_embeddings .* at most 16777216"),
])
def test_a_damaged_checkpoint_is_refused_in_one_line(tmp_path: Path, how: str, message: str, streamed: bool) -> None:
    if how == "pickle" and streamed:
        message = r"Expected \*\.safetensors weights .* for the layer-streamed engine"
    folder = damaged(tmp_path, how.split("=")[0] if "=" not in how else how)
    with pytest.raises(CheckpointError, match=message) as caught:
        load_engine(folder, streamed=streamed)
    assert "\n" not in str(caught.value)


def test_the_cli_says_it_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from detjac.cli.main import main

    folder = damaged(tmp_path, "num_hidden_layers=400000000")
    (tmp_path / "p.txt").write_text("a b c\n")
    out = tmp_path / "run.zarr"
    for extra in ([], ["--streamed"]):
        result = CliRunner().invoke(main, ["run", str(folder), str(tmp_path / "p.txt"), "--out", str(out), *extra])
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert result.output.strip().startswith("Error: Expected num_hidden_layers") and not out.exists()
