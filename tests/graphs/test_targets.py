"""A graph's target: a contrast of two logits or one against the mean, and the first position set aside.

Exactness: a contrast's value is the two logits' difference and its graph complete below 1e-12; the tokens'
contributions sum to the target; with the first position set aside, the replay without anything set aside gives the
trace's own values, the set-aside value equals the frozen Jacobian applied to the embeddings without the first one
(the pieces' own forward, an independent path), the graph is complete in that system (its links from the pullbacks,
its values from the replay), and nothing at the first position drives anything. Bad targets are refused before any
work."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from detjac.cli.main import main as cli
from detjac.engine import FrozenValues, InMemoryEngine, StreamedEngine, activations, load_engine, tiny_model
from detjac.errors import InvalidArgumentError, UnsupportedModelError
from detjac.graph_settings import GraphSettings, LogitTarget, parse_target
from detjac.graphs import attribution_graph

PROMPT = "The capital of France is"
IDS = [3, 17, 5, 42, 9, 11, 2, 30]
SMALL = dict(max_nodes=60, rows_per_pass=32)


@pytest.fixture(scope="module")
def default() -> InMemoryEngine:
    return load_engine("default", dtype=torch.float64)


@pytest.fixture(scope="module")
def trace(default):
    return default.trace(PROMPT)


def _model(family: str, seed: int = 2) -> torch.nn.Module:
    model = tiny_model(family, seed=seed).to(torch.float64)
    with torch.no_grad():  # norms off their initial values, biases off zero: an affine family's constants matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def test_the_target_grammar():
    assert parse_target("' Paris'") == LogitTarget(" Paris")
    assert parse_target("' Paris' - ' London'") == LogitTarget(" Paris", " London")
    assert parse_target('" it\'s"-mean') == LogitTarget(" it's")
    assert parse_target("#9 - #4") == LogitTarget(9, 4)
    assert parse_target("' Paris' - ' London'").text == "' Paris' - ' London'"
    assert parse_target("#9").text == "#9 - mean"
    for bad, said in (("Paris", "quoted token"), ("''", "inside each pair"), ("' a' - ' a'", "two different"),
                      ("' a' + ' b'", "quoted token")):
        with pytest.raises(InvalidArgumentError, match=said):
            parse_target(bad)
    with pytest.raises(InvalidArgumentError, match="quoted token"):
        GraphSettings(target="Paris").check()


def test_a_default_graph_keeps_its_stored_identity():
    assert GraphSettings().stored() == {"max_nodes": 7500, "node_threshold": 0.8, "edge_threshold": 0.98}
    asked = GraphSettings(target="' a' - ' b'", aside_first=True)
    assert GraphSettings.of_stored(asked.stored()).stored() == asked.stored()
    assert asked.stored()["target"] == "' a' - ' b'" and asked.stored()["aside_first"] is True


def test_a_contrast_is_the_difference_of_two_logits_exactly(default, trace):
    g = attribution_graph(default, PROMPT, GraphSettings(target="' the' - ' a'", **SMALL))
    logits = default.logits(trace.output).double()
    the, a = (default.tokenizer.encode(t, add_special_tokens=False)[0] for t in (" the", " a"))
    assert g.n_logits == 1 and g.logit_ids == [the] and g.minus_id == a and g.minus_token == " a"
    assert abs(g.logit_values[0] - float(logits[the] - logits[a])) < 1e-12
    assert g.worst_completeness < 1e-12
    assert abs(g.token_contributions[0].sum() - g.logit_values[0]) < 1e-12  # a linear family: tokens only
    assert abs(g.constants_contribution[0]) < 1e-12


def test_the_top_logits_get_signed_token_contributions_that_sum_to_each(default):
    g = attribution_graph(default, PROMPT, GraphSettings(max_logits=3, **SMALL))
    assert g.token_contributions.shape == (g.n_logits, g.n_tokens)
    assert np.abs(g.token_contributions.sum(1) - g.logit_values).max() < 1e-12


def test_the_replay_without_anything_aside_is_the_trace(default, trace):
    own = FrozenValues.first_aside(default, trace, aside=False)
    acts = dict(activations(default, trace))
    for layer, z in acts.items():
        assert (own.neurons[layer] - z).abs().max() <= 1e-12 * z.abs().max()
    assert (own.output - trace.output).abs().max() < 1e-12 and own.aside == ()


def test_the_first_position_set_aside_exactly(default, trace):
    g = attribution_graph(default, PROMPT, GraphSettings(aside_first=True, max_logits=2, **SMALL))
    full = attribution_graph(default, PROMPT, GraphSettings(max_logits=2, **SMALL))
    assert g.aside == (0,) and g.worst_completeness < 1e-12
    x = trace.embeddings.clone()
    x[0] = 0
    w = _vectors(default, trace, g.logit_ids)
    pushed = (w @ default.push(trace, x[None])[0]).double().numpy()  # J x without the first token, through the pieces
    assert np.abs(g.logit_values - pushed).max() < 1e-12 * np.abs(pushed).max()
    assert g.token_contributions[:, 0].tolist() == [0.0, 0.0]  # the rest is unchanged: J is the same system's
    assert np.abs(g.token_contributions[:, 1:] - full.token_contributions[:, 1:]).max() < 1e-12
    assert (g.neurons[:, 2] > 0).all()  # no neuron at the first position is a node
    first = g.layout.tokens
    assert not g.adjacency[:, first].any()  # the first token drives nothing


def _vectors(engine, trace, ids):
    from detjac.graphs import logit_vectors

    return logit_vectors(engine, trace.output, ids)


@pytest.mark.parametrize("family", ["gpt2", "gemma3"])
def test_contrast_and_aside_are_complete_on_an_affine_and_a_sandwich_norm_family(family):
    engine = InMemoryEngine(_model(family))
    top = attribution_graph(engine, IDS, GraphSettings(max_logits=2, **SMALL))
    own = FrozenValues.first_aside(engine, engine.trace(IDS), aside=False)
    for layer, z in activations(engine, engine.trace(IDS)):
        assert (own.neurons[layer] - z).abs().max() <= 1e-12 * z.abs().max()
    a, b = top.logit_ids[:2]
    g = attribution_graph(engine, IDS, GraphSettings(target=f"#{a} - #{b}", aside_first=True, **SMALL))
    assert g.worst_completeness < 1e-12 and g.aside == (0,) and (g.neurons[:, 2] > 0).all()
    if g.n_biases:  # the constants added at the first position go with it
        at = g.layout
        assert not g.adjacency[:, at.bias(np.arange(g.n_layers), 0)].any()
    total = g.token_contributions[0].sum() + g.constants_contribution[0]
    assert abs(total - g.logit_values[0]) < 1e-12


def test_bad_targets_and_asides_are_refused_before_any_work(default):
    for target, said in (("' Paris'", "one token.*Got 2 tokens: ' Par', 'is'"), ("#999999", r"token id in \[0, ")):
        with pytest.raises(InvalidArgumentError, match=said):
            attribution_graph(default, PROMPT, GraphSettings(target=target, **SMALL))
    with pytest.raises(InvalidArgumentError, match="at least 2 tokens"):
        attribution_graph(default, [5], GraphSettings(aside_first=True, **SMALL))
    streamed = StreamedEngine(_model("llama"))
    with pytest.raises(InvalidArgumentError, match="whole model in memory for setting the first position aside"):
        attribution_graph(streamed, IDS, GraphSettings(aside_first=True, **SMALL))
    with pytest.raises(InvalidArgumentError, match="by id"):
        attribution_graph(InMemoryEngine(_model("llama")), IDS, GraphSettings(target="' a'", **SMALL))
    with pytest.raises(UnsupportedModelError, match="dense MLP for setting the first position aside"):
        attribution_graph(InMemoryEngine(tiny_model("qwen3_moe", seed=3)), IDS, GraphSettings(aside_first=True,
                                                                                                **SMALL))


def test_the_command_writes_and_says_the_target(tmp_path):
    out = tmp_path / "c.json"
    result = CliRunner().invoke(cli, ["graph", "-p", PROMPT, "--out", str(out), "--max-nodes", "60",
                                      "--target", "' the' - ' a'", "--aside-first"])
    assert result.exit_code == 0, result.output
    assert "target       ' the' - ' a' = " in result.output and "set aside    the first position" in result.output
    info = json.loads(out.read_text())["metadata"]["info"]
    assert info["target"] == "' the' - ' a'" and info["aside"] == [0]
    made = info["token_contributions"]
    assert made["values"][0][0] == 0.0 and abs(sum(made["values"][0]) + made["constants"][0]
                                               - made["target_values"][0]) < 1e-12
    logit = next(n for n in json.loads(out.read_text())["nodes"] if n["feature_type"] == "logit")
    assert logit["node_id"] == made["targets"][0] and '" the" − " a"' in logit["clerp"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    alone = CliRunner().invoke(cli, ["run", "default", str(prompts), "--out", str(tmp_path / "s.zarr"),
                                     "--graph-aside-first"])
    assert alone.exit_code == 2 and "Expected --graph-aside-first with --graph" in alone.output


def test_the_heads_direct_effects_are_of_the_system_set_aside(default, trace):
    from detjac.engine import OUTPUT, Seed, neurons

    g = attribution_graph(default, PROMPT, GraphSettings(aside_first=True, target="' the' - ' a'", **SMALL))
    system = FrozenValues.first_aside(default, trace)
    w = _vectors(default, trace, [g.logit_ids[0], g.minus_id])
    w = w[:1] - w[1:]
    p = trace.position
    with default.walk(trace) as walk, torch.no_grad():
        cotangent = walk.final(Seed(OUTPUT, w))[0, p]  # leaving the last layer, at the position
    mlps = sum(float(cotangent @ mlp.output(system.neurons[layer])[p]) for layer, _, mlp in neurons(default, trace))
    total = g.head_effects[0].sum() + mlps + float(cotangent @ system.inputs[0][p])  # a linear family: no constants
    assert abs(total - g.logit_values[0]) < 1e-12 * np.abs(g.head_effects).max()
    full = attribution_graph(default, PROMPT, GraphSettings(target="' the' - ' a'", **SMALL))
    assert np.abs(full.head_effects - g.head_effects).max() > 1e-3  # the first position's part is gone


@pytest.mark.slow
def test_on_smollm2_paris_rather_than_the_is_carried_by_france_with_or_without_the_sink():
    """The real model: ' Paris' - ' the' on "The capital of France is" (docs/graphs.md's worked contrast), its
    tokens' contributions led by ' France' and summing to it, unchanged but for the first one when that is set aside,
    and both graphs complete; the head with the largest direct effect is L23.H4 in both."""
    from real_models import smollm2_path

    engine = load_engine(str(smollm2_path()))
    settings = dict(target="' Paris' - ' the'", max_nodes=50)
    full = attribution_graph(engine, PROMPT, GraphSettings(**settings))
    aside = attribution_graph(engine, PROMPT, GraphSettings(**settings, aside_first=True))
    for g in (full, aside):
        assert g.worst_completeness < 1e-12 and abs(g.constants_contribution[0]) < 1e-12 * abs(g.logit_values[0])
        assert g.tokens[int(np.argmax(g.token_contributions[0]))] == " France"
        effects = np.abs(g.head_effects[0])
        assert np.unravel_index(effects.argmax(), effects.shape) == (23, 4)
    assert aside.token_contributions[0, 0] == 0.0
    assert np.abs(aside.token_contributions[0, 1:] - full.token_contributions[0, 1:]).max() < 1e-12
    assert abs(full.logit_values[0] - aside.logit_values[0] - full.token_contributions[0, 0]) < 1e-12
    assert (aside.neurons[:, 2] > 0).all()
