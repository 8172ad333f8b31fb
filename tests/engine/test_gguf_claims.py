"""A GGUF header is checked against its tensor table before anything is built or allocated for it, and crafted
values are one clear line naming the field and the value, never a traceback. The files
are tiny Llamas written here with the gguf package's writer."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.engine.checkpoints.gguf import GGUFWeights, gguf_config, gguf_tokenizer, read_gguf_header
from detjac.errors import CheckpointError

D, HEADS, KV, FF, VOCAB = 8, 2, 1, 16, 6


def llama_tensors(layers: int = 1) -> dict[str, np.ndarray]:
    """A tiny Llama's tensors in torch order (the writer reverses the dims into GGUF order)."""
    rng = np.random.default_rng(0)
    head = D // HEADS
    shapes = {"attn_norm.weight": (D,), "attn_q.weight": (D, D), "attn_k.weight": (KV * head, D),
              "attn_v.weight": (KV * head, D), "attn_output.weight": (D, D), "ffn_norm.weight": (D,),
              "ffn_gate.weight": (FF, D), "ffn_up.weight": (FF, D), "ffn_down.weight": (D, FF)}
    tensors = {"token_embd.weight": rng.normal(size=(VOCAB, D)), "output_norm.weight": np.ones(D),
               "output.weight": rng.normal(size=(VOCAB, D))}
    for i in range(layers):
        tensors.update({f"blk.{i}.{name}": rng.normal(size=shape) for name, shape in shapes.items()})
    return {name: value.astype(np.float32) for name, value in tensors.items()}


def write_llama(path: Path, meta: dict | None = None, tensors: dict | None = None, layers: int = 1,
                extra: list | None = None) -> Path:
    """A complete tiny Llama GGUF; ``meta`` overrides the header's values (None drops one), ``extra`` adds raw
    key-values ``(key, writer method, value)``."""
    from gguf import GGUFWriter

    values = {"block_count": layers, "context_length": 64, "embedding_length": D, "feed_forward_length": FF,
              "head_count": HEADS, "head_count_kv": KV, "layer_norm_rms_eps": 1e-5, "rope_freq_base": 10000.0,
              "tokenizer_model": "gpt2", "token_list": [chr(97 + i) for i in range(VOCAB)], "bos_token_id": 0,
              **(meta or {})}
    w = GGUFWriter(str(path), "llama")
    for key, value in values.items():
        if value is not None:
            getattr(w, f"add_{key}")(value)
    for key, method, value in extra or []:
        getattr(w, method)(key, value)
    for name, array in (tensors or llama_tensors(layers)).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_well_formed_tiny_llama_passes_every_check(tmp_path):
    path = write_llama(tmp_path / "ok.gguf", layers=2)
    config = gguf_config(path)
    assert (config.num_hidden_layers, config.hidden_size) == (2, D)
    weights = GGUFWeights.for_config(path, config)
    assert tuple(weights.read("model.layers.1.mlp.up_proj.weight").shape) == (FF, D)


@pytest.mark.parametrize(("meta", "layers", "message"), [
    ({"block_count": 20000}, 1, "Expected tensors for the 20000 layers llama.block_count claims in"),
    ({"block_count": 0}, 1, "Expected llama.block_count to be a positive integer in the GGUF file"),
    ({"block_count": 1}, 2, "Expected tensors for the 1 layers llama.block_count claims in"),
    ({"head_count": 0}, 1, "Expected llama.attention.head_count to be a positive integer"),
    ({"head_count": 7}, 1, "Expected llama.attention.head_count 7 (and head_count_kv 1) to split"),
    ({"embedding_length": 2**31}, 1, "Expected token_embd.weight of width 2147483648 (llama.embedding_length)"),
    ({"feed_forward_length": 2**30}, 1, "Expected ffn_up.weight with 1073741824 rows"),
])
def test_header_claims_the_tensor_table_does_not_bear_out_are_refused_before_building(tmp_path, meta, layers,
                                                                                       message):
    path = write_llama(tmp_path / "claims.gguf", meta, layers=layers)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gguf_config(path)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a b\n")
    result = CliRunner().invoke(main, ["run", str(path), str(prompts), "--out", str(tmp_path / "s.zarr")])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "s.zarr").exists()


def test_a_layer_missing_a_tensor_is_refused_naming_it(tmp_path):
    tensors = llama_tensors(2)
    del tensors["blk.1.ffn_up.weight"]
    with pytest.raises(CheckpointError, match=r"Expected layer 1 of .* Got a difference at blk\.1\.ffn_up\.weight"):
        gguf_config(write_llama(tmp_path / "hole.gguf", tensors=tensors, layers=2))


@pytest.mark.parametrize(("method", "value"), [("add_uint32", 0), ("add_float32", 0.5), ("add_string", "x"),
                                               ("add_array", [1, 2]), ("add_uint32", 48)])
def test_a_crafted_alignment_is_named(tmp_path, method, value):
    path = write_llama(tmp_path / "align.gguf", extra=[("general.alignment", method, value)])
    got = "an array of 2 values" if isinstance(value, list) else repr(value)
    with pytest.raises(CheckpointError) as info:
        read_gguf_header(path)
    assert str(info.value).startswith("Expected general.alignment to be a power of two up to 1048576 in the GGUF")
    assert str(info.value).endswith(f"Got {got}.")


def test_a_weight_of_the_wrong_shape_is_named_before_it_is_read(tmp_path):
    tensors = llama_tensors()
    tensors["output_norm.weight"] = np.ones(D + 1, np.float32)
    path = write_llama(tmp_path / "shape.gguf", tensors=tensors)
    with pytest.raises(CheckpointError, match=r"Expected tensor output_norm\.weight of shape \(8,\) .* Got shape "
                                              r"\(9,\)"):
        GGUFWeights.for_config(path, gguf_config(path))


@pytest.mark.parametrize(("meta", "message"), [
    ({"token_list": []}, "Expected a non-empty token list (tokenizer.ggml.tokens)"),
    ({"bos_token_id": 99}, "Expected tokenizer.ggml.bos_token_id to be a token id below 6"),
    ({"tokenizer_model": "bpe-of-my-own"}, "Expected tokenizer.ggml.model to be one of gemma4, gpt2, llama, t5"),
])
def test_bad_tokenizer_metadata_is_named(tmp_path, meta, message):
    path = write_llama(tmp_path / "tok.gguf", meta)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gguf_config(path)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gguf_tokenizer(path)


@pytest.mark.parametrize("key", ["layer_norm_rms_eps", "rope_freq_base"])
def test_a_non_finite_setting_is_named_as_such(tmp_path, key):
    path = write_llama(tmp_path / "nan.gguf", {key: math.nan})
    with pytest.raises(CheckpointError, match=r"Expected llama\.\S+ to be a finite number in the GGUF file .* "
                                              r"Got nan\."):
        read_gguf_header(path)


def test_a_non_finite_weight_is_named_when_read(tmp_path):
    tensors = llama_tensors()
    tensors["blk.0.ffn_up.weight"][3, 2] = np.nan
    path = write_llama(tmp_path / "nanw.gguf", tensors=tensors)
    weights = GGUFWeights.for_config(path, gguf_config(path))
    with pytest.raises(CheckpointError, match=r"Expected finite weights in tensor blk\.0\.ffn_up\.weight"):
        weights.read("model.layers.0.mlp.up_proj.weight")


def test_not_a_gguf_is_said_once(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(CheckpointError) as info:
        read_gguf_header(bad)
    assert str(info.value).startswith("Expected a GGUF file (it begins with") and "readable" not in str(info.value)
