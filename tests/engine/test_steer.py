"""Steering with a concept prompt's layer Jacobians: the operator, the hook, λ = 0, and `detjac steer`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from store_helpers import run_default, write_prompts

from detjac.cli.main import main
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.engine.tools.steer import SteeringOperator, generate, steering
from detjac.errors import InvalidArgumentError

CONCEPT = "Whale, n. (Zool.) Any aquatic mammal"


def test_vectors_follow_the_definition():
    rng = np.random.default_rng(0)
    n, d = 3, 5
    op = SteeringOperator(0, torch.from_numpy(rng.standard_normal((n, d, d))))
    for m, start in ((2, 0), (6, 0), (6, 4)):
        x = torch.from_numpy(rng.standard_normal((m, d)))
        expected = torch.stack([sum((op.operators[n - 1 - i] @ x[j - i] for i in range(n) if j - i >= 0),
                                    torch.zeros(d, dtype=x.dtype)) for j in range(start, m)])
        torch.testing.assert_close(op.vectors(x, start), expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(InvalidArgumentError, match=r"shape \(d, n_tokens, d\)"):
        SteeringOperator.from_jacobian(0, torch.zeros(4, 2, 3))


def test_the_hook_adds_the_scaled_vector_at_the_layer():
    model = tiny_model("llama")
    d = model.config.hidden_size
    op = SteeringOperator(1, torch.randn(4, d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    seen: list[torch.Tensor] = []  # what layers 1 and 2 receive: the outputs of layers 0 and 1
    for i in (1, 2):
        model.model.layers[i].register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0] if args else
                                                                                          kwargs["hidden_states"]),
                                                        with_kwargs=True)
    with torch.no_grad():
        plain_logits = model(ids).logits
        with steering(model, op, 0.5):
            steered_logits = model(ids).logits
        model(ids)  # the hooks are gone after the block
    (before, h), (before_steered, steered), (_, after) = seen[0:2], seen[2:4], seen[4:6]
    h = h[0]
    v = op.vectors(model.get_input_embeddings()(ids)[0])
    expected = h + 0.5 * h.norm(dim=-1, keepdim=True) * v / v.norm(dim=-1, keepdim=True)
    expected[0] = h[0]  # the first position is left alone
    torch.testing.assert_close(steered[0], expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(before_steered, before)  # layers before are untouched
    torch.testing.assert_close(after[0], h)
    assert not torch.allclose(steered_logits, plain_logits)
    with pytest.raises(InvalidArgumentError, match="Expected a layer in"):
        with steering(model, SteeringOperator(9, op.operators), 1.0):
            pass
    with pytest.raises(InvalidArgumentError, match="from another model"):
        with steering(model, SteeringOperator(0, op.operators[:, :3, :3]), 1.0):
            pass


def test_zero_strength_is_the_unsteered_model():
    model = tiny_model("qwen3")
    ids = [1, 8, 3, 22, 4]
    op = SteeringOperator(0, torch.randn(2, model.config.hidden_size, model.config.hidden_size, dtype=torch.float64))
    plain = generate(model, ids, 8)
    assert generate(model, ids, 8, op, 0.0) == plain
    with torch.no_grad():
        reference = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert reference[0, len(ids):].tolist() == plain


@pytest.fixture(scope="module")
def concept_store(tmp_path_factory):
    return run_default(tmp_path_factory.mktemp("steer"), [CONCEPT], "c.zarr", "--layers", "1",
                       "--components", "layer,mlp")


def test_the_concept_operators_reconstruct_the_concept_layer_output(concept_store):
    """Applied to the concept's own embeddings, v at the last position is layer 1's output: the alignment."""
    prompt = next(iter(concept_store))
    op = SteeringOperator.from_jacobian(1, prompt.layerwise("layer.1", lazy=False))
    v = op.vectors(torch.from_numpy(prompt.array("embeddings")))
    np.testing.assert_allclose(v[-1].numpy(), prompt.layerwise("layer.1", "output"), rtol=1e-12, atol=1e-10)


def test_steer_command(concept_store, tmp_path):
    pid = concept_store.prompt_ids()[0]
    source = f"{concept_store.path}:{pid}"
    one = CliRunner().invoke(main, ["steer", "--concept-from", source, "--layer", "1", "--strength", "2",
                                    "--prompt", "Ream, n. A bundle of", "--max-new-tokens", "6"])
    assert one.exit_code == 0, one.output
    assert "unsteered" in one.output and "λ=2" in one.output
    prompts = write_prompts(tmp_path / "p.txt", ["Ream, n. A bundle of", "Limber, v. t. To attach"])
    table = CliRunner().invoke(main, ["steer", "default", "--concept-from", source, "--layer", "-3", "--prompts",
                                      str(prompts), "--strengths", "0,4", "--max-new-tokens", "6",
                                      "--concept-tokens", " aquatic, mammal", "--table", str(tmp_path / "s.csv")])
    assert table.exit_code == 0, table.output
    lines = (tmp_path / "s.csv").read_text().splitlines()
    assert lines[0].startswith("strength,prompts,share_with_concept") and len(lines) == 3
    counted = next(line for line in table.output.splitlines() if line.startswith("concept tokens:"))
    assert counted.count("'") == 4 and "' aquatic'" in counted and "' mamm'" in counted

    for args, message in (
        (["--layer", "2", "--prompt", "x"], "Expected the layerwise Jacobian layer.2"),
        (["--layer", "7", "--prompt", "x"], "Expected a layer in [-4, 4)"),
        (["--layer", "1"], "Expected --prompt TEXT or --prompts FILE"),
    ):
        bad = CliRunner().invoke(main, ["steer", "--concept-from", source, *args])
        assert bad.exit_code != 0 and message in bad.output, bad.output
    bad = CliRunner().invoke(main, ["steer", "--concept-from", "nocolon", "--layer", "1", "--prompt", "x"])
    assert bad.exit_code == 2 and "STORE:PROMPT_ID" in bad.output


def test_steer_refuses_a_store_of_another_model(concept_store, llama_checkpoint):
    pid = concept_store.prompt_ids()[0]
    bad = CliRunner().invoke(main, ["steer", str(llama_checkpoint), "--concept-from", f"{concept_store.path}:{pid}",
                                    "--layer", "1", "--prompt", "x"])
    assert bad.exit_code == 1 and f"Expected a store of the model {llama_checkpoint}" in bad.output, bad.output
    assert Path(concept_store.path).name in bad.output and "!=" in bad.output  # both identities, where they differ
