"""Every head's direct effect on a graph's logits (docs/graphs.md, "Direct effects of heads"), exactly, in float64.

The sum rule: for each target, the direct effects of every head of every layer, of every layer's MLP output at the
position (``g · (h_{l+1} - mid_l)[p]``), of the embedding's stream (``g · h_0[p]``) and of the constants (an affine
family's attention biases and norm shifts, here computed from the model's own weights: with the probabilities' rows
summing to one, a layer's attention adds ``W_o (W_v β + b_v) + b_o`` whatever it attends to) sum to the target's
value; and each layer's heads sum to its attention output's direct effect less its constants. On the shipped default
model, on tiny random models (linear, affine, with a post-attention norm), streamed and in memory; with another
system's layer inputs; in the JSON and the store; bad input refused before any layer is read.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from detjac.engine import OUTPUT, InMemoryEngine, Seed, StreamedEngine, load_engine
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.errors import InvalidArgumentError
from detjac.graph_settings import GraphSettings
from detjac.graphs import attribution_graph, graph_dict, head_effects
from detjac.graphs.targets import logit_targets
from detjac.store.graph_tables import graph_json, graph_tables

SUM_BOUND = 1e-12  # relative to the largest term of the sum
IDS = [3, 17, 5, 42, 9, 11]  # longer than a tiny model's sliding window (4)
FAMILIES = ["llama", "gpt2", "qwen2", "gemma3_text", "olmo2"]  # linear, affine (LayerNorm; value biases), post-norms


def _tiny(family: str) -> torch.nn.Module:
    model = tiny_model(family, seed=3).to(torch.float64)
    model.requires_grad_(False)
    with torch.no_grad():  # norm weights off their initial values (Gemma's start at 0), biases off 0
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p, generator=torch.Generator().manual_seed(5)))
    return model


def _states(engine, trace, vectors):
    """(g (K, d) leaving the last layer at p, every layer's input and the output (L + 1 of (n, d)), mids (L))."""
    with engine.walk(trace) as walk, torch.no_grad():
        g = walk.final(Seed(OUTPUT, vectors))[:, trace.position]
        inputs, mids = [], []
        for layer in range(engine.n_layers):
            with walk.layer(layer) as pull:
                inputs.append(pull.input)
                mids.append(pull.mid)
        inputs.append(walk.residual_ends()[1])
    return g, inputs, mids


def _constants(model: torch.nn.Module, family: str) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """(each layer's attention constant (d,), the final norm's shift or None), from the weights (module docstring)."""
    if family == "gpt2":
        blocks, d = model.transformer.h, model.config.n_embd
        zero = torch.zeros(d, dtype=torch.float64)
        attn = [b.attn.c_proj(b.attn.c_attn(b.ln_1(zero))[2 * d:]) for b in blocks]
        return attn, model.transformer.ln_f.bias
    if family == "qwen2":
        cfg = model.config
        hd = cfg.hidden_size // cfg.num_attention_heads
        r = cfg.num_attention_heads // cfg.num_key_value_heads
        attn = [layer.self_attn.o_proj(layer.self_attn.v_proj.bias.view(-1, hd).repeat_interleave(r, 0).reshape(-1))
                for layer in model.model.layers]
        return attn, None
    return [torch.zeros(model.config.hidden_size, dtype=torch.float64)] * model.config.num_hidden_layers, None


def _check_sum_rule(engine, trace, vectors, values, effects, constants=None):
    attn_c, final_c = constants or ([None] * engine.n_layers, None)
    g, inputs, mids = _states(engine, trace, vectors)
    p, L = trace.position, engine.n_layers
    terms = [torch.as_tensor(effects).reshape(len(vectors), -1), (g @ inputs[0][p])[:, None]]
    for layer in range(L):
        attention = g @ (mids[layer] - inputs[layer])[p]
        const = g @ attn_c[layer] if attn_c[layer] is not None else torch.zeros_like(attention)
        heads = torch.as_tensor(effects[:, layer]).sum(-1)
        scale = torch.maximum(attention.abs(), torch.as_tensor(np.abs(effects[:, layer]).max(-1)))
        assert ((heads + const - attention).abs() <= SUM_BOUND * scale.clamp_min(1e-300)).all(), layer
        terms += [const[:, None], (g @ (inputs[layer + 1] - mids[layer])[p])[:, None]]
    if final_c is not None:
        terms.append((vectors @ final_c)[:, None])
    terms = torch.cat(terms, dim=1)
    total = terms.sum(1)
    assert ((total - values).abs() <= SUM_BOUND * terms.abs().max(1).values).all(), (total, values)


@pytest.fixture(scope="module")
def default_graph():
    engine = load_engine("default", dtype="float64")
    return engine, attribution_graph(engine, "The capital of France is", GraphSettings(max_nodes=20))


def test_the_default_model_s_heads_meet_the_sum_rule(default_graph):
    engine, graph = default_graph
    trace = engine.trace(graph.token_ids)
    targets = logit_targets(engine, trace.output, len(graph.logit_ids), 1.0, graph.logit_ids)
    heads = engine.config.num_attention_heads
    assert graph.head_effects.shape == (len(graph.logit_ids), engine.n_layers, heads)
    assert np.array_equal(graph.head_effects, head_effects(engine, trace, targets.vectors))
    assert np.allclose(targets.values.numpy(), graph.logit_values, rtol=0, atol=1e-12)
    _check_sum_rule(engine, trace, targets.vectors, targets.values, graph.head_effects)
    assert np.abs(graph.head_effects).max() > 0.1  # heads that matter: the rule is not met by zeros


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_heads_meet_the_sum_rule(family):
    model = _tiny(family)
    engine = InMemoryEngine(model)
    trace = engine.trace(IDS)
    targets = logit_targets(engine, trace.output, 3, 1.0)
    effects = head_effects(engine, trace, targets.vectors)
    _check_sum_rule(engine, trace, targets.vectors, targets.values, effects, _constants(model, family))


def test_the_streamed_engine_gives_the_same_effects():
    model = _tiny("gemma3_text")
    engines = [InMemoryEngine(model), StreamedEngine(model, max_memory="cpu=1GiB")]
    got = []
    for engine in engines:
        trace = engine.trace(IDS)
        got.append(head_effects(engine, trace, logit_targets(engine, trace.output, 2, 1.0).vectors))
    assert np.abs(got[0] - got[1]).max() <= SUM_BOUND * np.abs(got[0]).max()


def test_another_system_s_layer_inputs_give_its_effects(default_graph):
    engine, graph = default_graph
    trace = engine.trace(graph.token_ids)
    vectors = logit_targets(engine, trace.output, 2, 1.0).vectors
    own = head_effects(engine, trace, vectors)
    _, inputs, _ = _states(engine, trace, vectors)
    other = head_effects(engine, trace, vectors, {2: 3.0 * inputs[2]})  # the frozen system is linear in its input
    assert np.abs(other[:, 2] - 3.0 * own[:, 2]).max() <= 1e-12 * np.abs(own[:, 2]).max()
    assert np.array_equal(np.delete(other, 2, axis=1), np.delete(own, 2, axis=1))


def test_the_json_and_the_store_carry_the_effects(default_graph):
    _, graph = default_graph
    data = json.loads(json.dumps(graph_dict(graph, slug="france", model="default"), allow_nan=False))
    effects = data["metadata"]["info"]["head_effects"]
    logits = [n["node_id"] for n in data["nodes"] if n["feature_type"] == "logit"]
    assert effects["targets"] == logits and len(logits) == len(graph.logit_ids)
    assert np.array_equal(np.asarray(effects["values"]), graph.head_effects)
    assert graph_json(*graph_tables(data)) == data


def test_bad_input_is_refused_before_any_layer_is_read(default_graph):
    engine, graph = default_graph
    trace = engine.trace(graph.token_ids)
    d, n = engine.d_model, len(graph.token_ids)
    vectors = torch.zeros(1, d, dtype=torch.float64)
    with pytest.raises(InvalidArgumentError, match=rf"Expected target vectors of shape \(K, {d}\). Got \(1, 3\)"):
        head_effects(engine, trace, vectors[:, :3])
    last = engine.n_layers - 1
    with pytest.raises(InvalidArgumentError, match=rf"Expected layer inputs keyed by layers 0 to {last}"):
        head_effects(engine, trace, vectors, {engine.n_layers: torch.zeros(n, d)})
    with pytest.raises(InvalidArgumentError, match=rf"Expected layer 1's input of shape \({n}, {d}\). Got \({n}, 2\)"):
        head_effects(engine, trace, vectors, {1: torch.zeros(n, 2)})
    autograd = InMemoryEngine(engine.model, sweeps="autograd")
    with pytest.raises(InvalidArgumentError, match="explicit pieces"):
        head_effects(autograd, autograd.trace(graph.token_ids), vectors)


@pytest.mark.slow
def test_smollm2_s_largest_direct_effect_on_paris_is_l23_h4_as_the_stock_model_computes_it():
    from real_models import smollm2_path

    engine = load_engine(str(smollm2_path()))
    trace = engine.trace("The capital of France is")
    targets = logit_targets(engine, trace.output, 1, 1.0)
    assert engine.tokenizer.decode(targets.ids) == " Paris"
    effects = head_effects(engine, trace, targets.vectors)[0]
    assert np.unravel_index(np.abs(effects).argmax(), effects.shape) == (23, 4) and effects[23, 4] > 0
    _check_sum_rule(engine, trace, targets.vectors, targets.values, effects[None])
    # independently: the stock model's o_proj input for head 4 at p, through W_o's slice, against the target pulled
    # back through the final RMSNorm with its scale frozen (stock norms compute in float32: agreement to ~1e-7)
    model, p, seen = engine.model, trace.position, {}
    attention, norm = model.model.layers[23].self_attn, model.model.norm
    hooks = [attention.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("o", a[0][0, p])),
             norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("h", a[0][0, p]))]
    with torch.no_grad():
        model(torch.tensor([trace.token_ids]))
    for hook in hooks:
        hook.remove()
    hd = attention.head_dim
    out = attention.o_proj.weight[:, 4 * hd:5 * hd] @ seen["o"][4 * hd:5 * hd]
    g = targets.vectors[0] * norm.weight * torch.rsqrt(seen["h"].pow(2).mean() + norm.variance_epsilon)
    assert float(g @ out) == pytest.approx(effects[23, 4], rel=1e-6)
