"""The shipped default model: files, exactness through load_model, and the demo's code path."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.engine import InMemoryEngine, get_tokenizer, jacobian, load_model
from detjac.engine.checkpoints.default import DEFAULT_MODEL_DIR, default_model_dir, resolve_model
from detjac.runs.jacobian_run import DEMO_PROMPTS


@pytest.fixture(scope="module")
def default_model() -> torch.nn.Module:
    return load_model(default_model_dir(), dtype=torch.float64)


def test_shipped_files_match_the_model_card():
    files = {p.name for p in DEFAULT_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"} <= files
    weights = DEFAULT_MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= 25 * 2**20
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert 4096 <= config["vocab_size"] <= 16384 and 128 <= config["hidden_size"] <= 384
    training = json.loads((DEFAULT_MODEL_DIR / "training.json").read_text())
    assert training["model_safetensors_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    card = (DEFAULT_MODEL_DIR / "README.md").read_text()
    assert training["model_safetensors_sha256"] in card
    assert f"{training['heldout_perplexity']:.2f}" in card


@pytest.mark.slow
@pytest.mark.parametrize("prompt", DEMO_PROMPTS)
def test_load_model_reconstructs_exactly_in_float64(default_model, prompt):
    res = jacobian(InMemoryEngine(default_model), prompt)
    assert res.jacobian.dtype == torch.float64 and res.jacobian.shape[0] == default_model.config.hidden_size
    assert res.reconstruction_error < 1e-12
    ids = torch.tensor([res.token_ids])
    with torch.no_grad():
        stock = default_model(input_ids=ids).logits[0, -1]
    # The stock model computes its RMSNorm variance in float32 even for float64 weights, hence ~1e-6.
    torch.testing.assert_close(res.reconstruction_logits, stock, rtol=1e-6, atol=2e-5)
    assert res.reconstructed_next_token_id == int(stock.argmax())


def test_default_model_is_trained(default_model):
    """The shipped weights predict dictionary text far better than chance (a trained model)."""
    tok = get_tokenizer(default_model)
    ids = tok("Kitten, n. A young cat.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = default_model(input_ids=ids, labels=ids).loss
    assert float(loss) < 0.6 * torch.log(torch.tensor(float(default_model.config.vocab_size)))


def test_resolve_model_names_the_shipped_folder(tmp_path, monkeypatch):
    assert resolve_model("default") == DEFAULT_MODEL_DIR
    assert resolve_model("./some/where") == "./some/where"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").mkdir()
    assert resolve_model("default") == "default"  # a real folder of that name wins


@pytest.mark.slow
def test_demo_runs_on_the_shipped_model(tmp_path):
    plot = tmp_path / "spectra.png"
    result = CliRunner().invoke(main, ["demo", "--plot", str(plot), "--k", "2", "--top", "6"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert [int(i) for i in re.findall(r"^\[(\d)\] ", out, flags=re.M)] == [1, 2, 3]
    errors = [float(e) for e in re.findall(r"float64 reconstruction error (\S+);", out)]
    assert len(errors) == 3 and max(errors) < 1e-12
    ordinary = [float(e) for e in re.findall(r"non-detached Jacobian reconstructs with error (\S+)\)", out)]
    assert len(ordinary) == 3 and min(ordinary) > 1e-3
    assert len(re.findall(r"^  next token '", out, flags=re.M)) == 3
    combined_left = re.findall(r"^    #(\d) sigma \S+\s+left -> (.*)$", out, flags=re.M)
    assert [c[0] for c in combined_left] == ["1", "2"] * 3
    assert all(len(re.findall(r"'[^']*'|\"[^\"]*\"", c[1])) == 6 for c in combined_left)
    assert len(re.findall(r"right \[at .*, \d+% of \|v\|\^2\] -> ", out)) == 6
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    assert str(plot) in out


def test_an_engine_says_what_it_holds():
    """``print(engine)`` names more than the class and an address; ``help(load_engine)`` names GGUF files and
    ``default``."""
    from detjac.engine import load_engine

    engine = load_engine("default", dtype="float32")
    assert repr(engine) == ("<InMemoryEngine of 'default': Llama, float32, cpu, in memory, detached, 4 layers, "
                            "d_model 256>")
    assert "layer-streamed, ordinary" in repr(load_engine("default", streamed=True, detach=False))
    assert all(word in load_engine.__doc__ for word in ('"default"', "GGUF file", "hub id", "checkpoint folder"))
