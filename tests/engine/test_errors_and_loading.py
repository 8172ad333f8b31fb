"""Bad input gives specific, readable errors; checkpoints load through load_model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from detjac.engine import InMemoryEngine, get_tokenizer, jacobian, load_model
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.errors import CheckpointError, InvalidArgumentError, PromptError, UnsupportedModelError


def test_load_checkpoint_float64_and_reconstruct(llama_checkpoint):
    model = load_model(llama_checkpoint, dtype=torch.float64)
    assert model.dtype == torch.float64 and not model.training
    res = jacobian(InMemoryEngine(model), "The bridge out of Marin is the", row_block=64)
    assert res.tokens[0] == "<s>" and res.prompt == "The bridge out of Marin is the"
    assert res.reconstruction_error < 1e-12
    assert get_tokenizer(model).decode(res.token_ids, skip_special_tokens=True) == res.prompt


def test_load_keeps_checkpoint_dtype_when_asked(llama_checkpoint):
    assert load_model(llama_checkpoint, dtype=None).dtype == torch.float32


def test_already_loaded_model_is_accepted(llama_checkpoint):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    model = load_model(hf, dtype=torch.float64)
    assert model is hf and model.dtype == torch.float64
    # the tokenizer is found next to the weights the model came from
    assert jacobian(InMemoryEngine(model), "the sea").reconstruction_error < 1e-12


@pytest.mark.parametrize("prompt, expected", [
    ("", "Expected a prompt of at least one token. Got an empty string instead."),
    ("   \n", "Expected a prompt of at least one token. Got a whitespace-only string instead."),
    ([], "Expected a prompt of at least one token. Got no tokens instead."),
])
def test_empty_prompt(llama_checkpoint, prompt, expected):
    model = load_model(llama_checkpoint)
    with pytest.raises(PromptError) as e:
        jacobian(InMemoryEngine(model), prompt)
    assert str(e.value) == expected


def test_prompt_longer_than_context(llama_checkpoint):
    model = load_model(llama_checkpoint)
    with pytest.raises(PromptError, match=r"at most 64 tokens \(the model's max_position_embeddings\)\. "
                                          r"Got 65 tokens instead\."):
        jacobian(InMemoryEngine(model), [5] * 65)


def test_token_id_out_of_vocabulary():
    with pytest.raises(PromptError, match=r"Expected token ids in \[0, 160\)\. Got \[160\]"):
        jacobian(InMemoryEngine(tiny_model("llama")), [3, 160])


def test_text_prompt_without_tokenizer():
    with pytest.raises(PromptError, match="Expected a tokenizer"):
        jacobian(InMemoryEngine(tiny_model("llama")), "hello")


def test_bad_row_block_and_position(prompt_ids):
    model = tiny_model("llama")
    with pytest.raises(InvalidArgumentError, match="row_block to be a positive integer. Got 0"):
        jacobian(InMemoryEngine(model), prompt_ids, row_block=0)
    with pytest.raises(InvalidArgumentError, match=r"position in \[-13, 13\)\. Got 13"):
        jacobian(InMemoryEngine(model), prompt_ids, position=13)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="which does not exist"):
        load_model(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    assert "has no config.json, so it is not a checkpoint" in str(e.value)
    assert isinstance(e.value, OSError)


def test_config_without_weights(tmp_path, llama_checkpoint):
    (tmp_path / "config.json").write_text((llama_checkpoint / "config.json").read_text())
    with pytest.raises(CheckpointError, match="Got a config.json without weights"):
        load_model(tmp_path)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"hidden_size": ' + "9" * 5000 + "}",
                                  '{"rope_theta": Infinity}'])
def test_a_config_json_no_parser_can_hold_is_one_line(tmp_path, text):
    """A model folder's deep or overflowing config.json is one clear error, never a RecursionError traceback."""
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"Expected a readable JSON config\.json in .*\. Got: ") as caught:
        load_model(tmp_path)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(CheckpointError, match="which is a file"):
        load_model(f)


def test_unsupported_family_refused_before_loading_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "opt"}))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(UnsupportedModelError, match="model_type='opt'"):
        load_model(tmp_path)


def test_model_type_unknown_to_transformers_too(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "my_new_arch", "hidden_size": 8}))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(UnsupportedModelError, match=r"llama, mistral.*Got model_type='my_new_arch'"):
        load_model(tmp_path)


def test_single_token_prompt(llama_checkpoint):
    res = jacobian(InMemoryEngine(load_model(llama_checkpoint)), [1])
    assert res.jacobian.shape[1] == 1 and res.reconstruction_error < 1e-12


def test_remote_code_stays_off(tmp_path, llama_checkpoint):
    # A checkpoint asking for custom code is not executed unless the user opts in.
    cfg = json.loads((llama_checkpoint / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    for f in Path(llama_checkpoint).iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    model = load_model(tmp_path)
    assert type(model).__name__ == "LlamaForCausalLM"
