"""Exact attribution graphs: completeness on every family, the edges against an independent autograd of a hand-written
cut model, both engines alike, the pullback primitive's refusals, and bad input refused before anything is written."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from detjac.engine import (
    EMBEDDINGS,
    OUTPUT,
    InMemoryEngine,
    PullRequest,
    Seed,
    StreamedEngine,
    neurons_of,
    tiny_model,
    tiny_model_types,
)
from detjac.engine.tools.lens_pulls import pull_every_position
from detjac.errors import InvalidArgumentError, PromptError, UnsupportedModelError
from detjac.graph_settings import GraphSettings
from detjac.graphs import attribution_graph

IDS = [3, 17, 5, 42, 9, 11, 2, 30, 7, 19]  # longer than a tiny model's sliding window


def _model(family: str, seed: int = 1) -> torch.nn.Module:
    model = tiny_model(family, seed=seed).to(torch.float64)
    model.requires_grad_(False)
    with torch.no_grad():  # norm weights off their initial values (Gemma's start at 0, the others at 1), biases off 0
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _graph_families() -> list[str]:
    return [f for f in tiny_model_types() if f != "bert"]


@pytest.mark.parametrize("family", _graph_families())
def test_every_nodes_incoming_edges_sum_to_its_value(family):
    g = attribution_graph(InMemoryEngine(_model(family)), IDS, GraphSettings(max_nodes=60, rows_per_pass=16))
    assert g.n_neurons == 60 and g.n_logits >= 1
    assert g.worst_completeness < 1e-12, family
    # every edge goes up: a neuron's sources are tokens or neurons of lower layers at positions not after its own
    M = g.n_neurons
    src = np.nonzero(g.adjacency[:M, :M])
    assert (g.neurons[src[1], 0] < g.neurons[src[0], 0]).all()
    assert (g.neurons[src[1], 2] <= g.neurons[src[0], 2]).all()


def test_a_family_without_a_neuron_definition_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="attribution graphs.*post-norm layers"):
        attribution_graph(InMemoryEngine(_model("bert")), IDS, GraphSettings(max_nodes=5))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_both_engines_give_the_same_graph(family):
    model = _model(family)
    a = attribution_graph(InMemoryEngine(model), IDS, GraphSettings(max_nodes=40))
    b = attribution_graph(StreamedEngine(model), IDS, GraphSettings(max_nodes=40, rows_per_pass=7))
    assert np.array_equal(a.neurons, b.neurons)
    assert np.abs(a.adjacency - b.adjacency).max() <= 1e-12 * np.abs(a.adjacency).max()
    assert b.worst_completeness < 1e-12


# -- an independent computation: autograd of a hand-written Llama with every MLP's output given as its neurons ------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt().detach() * weight


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:  # (heads, n, hd)
    n, hd = x.shape[-2:]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.arange(n, dtype=torch.float32)[:, None] * inv
    ang = torch.cat([ang, ang], -1)
    rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * ang.cos().to(x.dtype) + rot * ang.sin().to(x.dtype)


def _cut_llama(model: torch.nn.Module, x: torch.Tensor, z: list[torch.Tensor] | None,
               delta: list[torch.Tensor] | None = None):
    """The detached Llama on embeddings ``x`` (n, d); with ``z`` each MLP's output is ``z[l] @ W_down^T`` (its
    neurons given), else the model's own, plus ``delta[l]`` added to its neurons (the total effect's handle).
    Returns (final normed state (n, d), [each layer's neurons (n, ffn)])."""
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd, eps, theta = cfg.hidden_size // heads, cfg.rms_norm_eps, cfg.rope_parameters["rope_theta"]
    n = x.shape[0]
    mask = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)
    h, own = x, []
    for i, layer in enumerate(model.model.layers):
        att = layer.self_attn
        a = _rms(h, layer.input_layernorm.weight, eps)
        q = _rope((a @ att.q_proj.weight.T).view(n, heads, hd).transpose(0, 1), theta)
        k = _rope((a @ att.k_proj.weight.T).view(n, kv, hd).transpose(0, 1), theta)
        v = (a @ att.v_proj.weight.T).view(n, kv, hd).transpose(0, 1)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        probs = torch.softmax(q @ k.transpose(1, 2) / hd**0.5 + mask, -1).detach()
        h = h + (probs @ v).transpose(0, 1).reshape(n, -1) @ att.o_proj.weight.T
        m = _rms(h, layer.post_attention_layernorm.weight, eps)
        gate = torch.nn.functional.silu(m @ layer.mlp.gate_proj.weight.T).detach()
        own.append(gate * (m @ layer.mlp.up_proj.weight.T) + (0 if delta is None else delta[i]))
        h = h + (own[-1] if z is None else z[i]) @ layer.mlp.down_proj.weight.T
    return _rms(h, model.model.norm.weight, eps), own


def test_edges_match_autograd_of_a_hand_written_cut_model():
    model = _model("llama", seed=4)
    engine = InMemoryEngine(model)
    g = attribution_graph(engine, IDS, GraphSettings(max_nodes=80, rows_per_pass=13))
    x = model.model.embed_tokens.weight[IDS].clone()
    _, acts = _cut_llama(model, x, None)
    W = model.lm_head.weight
    M, n = g.n_neurons, g.n_tokens
    assert np.allclose(g.activations, [float(acts[layer][p, i]) for layer, i, p in g.neurons], rtol=1e-12, atol=0)

    def edges(value_of) -> np.ndarray:  # one node's edges from every chosen neuron and every token
        xs = x.clone().requires_grad_(True)
        zs = [a.detach().clone().requires_grad_(True) for a in acts]
        y, own = _cut_llama(model, xs, zs)
        value = value_of(y, own)
        gx, *gz = torch.autograd.grad(value, [xs, *zs], allow_unused=True)
        gz = [torch.zeros_like(a) if gr is None else gr for a, gr in zip(acts, gz, strict=True)]
        row = np.zeros(M + n)
        for c, (layer, i, p) in enumerate(g.neurons):
            row[c] = float(acts[layer][p, i] * gz[layer][p, i])
        row[M:] = (gx * x).sum(-1).detach().numpy()
        total = float((gx * x).sum() + sum((a * gr).sum() for a, gr in zip(acts, gz, strict=True)))
        return row, total, float(value.detach())

    mean = W.mean(0)
    for k, t in enumerate(g.logit_ids):
        row, total, value = edges(lambda y, own, t=t: (W[t] - mean) @ y[g.position])
        assert abs(value - g.logit_values[k]) <= 1e-12 * abs(value)
        assert np.abs(g.adjacency[M + n + k, :M + n] - row).max() <= 1e-11 * np.abs(row).max()
        assert abs(total - value) <= 1e-12 * abs(value)
    for c in range(0, M, 7):
        layer, i, p = (int(v) for v in g.neurons[c])
        row, _, value = edges(lambda y, own, layer=layer, i=i, p=p: own[layer][p, i])
        assert np.abs(g.adjacency[c, :M + n] - row).max() <= 1e-11 * max(np.abs(row).max(), abs(value))


def test_total_attribution_matches_autograd_through_every_path():
    from detjac.graphs import logit_attribution, logit_vectors

    model = _model("llama", seed=5)
    engine = InMemoryEngine(model)
    trace = engine.trace(IDS)
    W = model.lm_head.weight
    t = int((W @ trace.output).argmax())
    got = dict(logit_attribution(engine, trace, logit_vectors(engine, trace.output, [t])))
    x = model.model.embed_tokens.weight[IDS].clone()
    _, acts = _cut_llama(model, x, None)
    deltas = [torch.zeros_like(a, requires_grad=True) for a in acts]
    y, _ = _cut_llama(model, x, None, deltas)
    grads = torch.autograd.grad((W[t] - W.mean(0)) @ y[-1], deltas)
    for layer, (a, g) in enumerate(zip(acts, grads, strict=True)):
        want = (a * g).detach()
        assert torch.allclose(got[layer][0], want, rtol=0, atol=1e-11 * want.abs().max()), layer


# -- bias nodes: an affine family's constants, against autograd of a hand-written cut GPT-2 ----------------------


def _gelu(u: torch.Tensor) -> torch.Tensor:
    return 0.5 * u * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (u + 0.044715 * u**3)))


def _cut_gpt2(model: torch.nn.Module, x: torch.Tensor, z: list[torch.Tensor] | None, t: torch.Tensor):
    """The detached GPT-2 on token embeddings ``x`` (n, d), every constant of layer ``l`` (its biases, its norms'
    shifts; layer 0's also the position embeddings) times ``t[l]``, the final norm's shift times ``t[L]``; with ``z``
    each MLP's output is ``z[l] @ W_proj`` (its neurons given). Returns (final normed state, [neurons (n, ffn)])."""
    tr, cfg = model.transformer, model.config
    heads, d = cfg.n_head, cfg.n_embd
    hd, eps, n = d // heads, cfg.layer_norm_epsilon, x.shape[0]

    def ln(h: torch.Tensor, norm: torch.nn.Module, shift: torch.Tensor) -> torch.Tensor:
        c = h - h.mean(-1, keepdim=True)
        return c * (c.pow(2).mean(-1, keepdim=True) + eps).rsqrt().detach() * norm.weight + shift * norm.bias

    mask = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)
    h, own = x + t[0] * tr.wpe.weight[:n], []
    for i, block in enumerate(tr.h):
        att, mlp = block.attn, block.mlp
        a = ln(h, block.ln_1, t[i])
        w, b = att.c_attn.weight, att.c_attn.bias
        q = (a @ w[:, :d] + b[:d]).view(n, heads, hd).transpose(0, 1)
        k = (a @ w[:, d:2 * d] + b[d:2 * d]).view(n, heads, hd).transpose(0, 1)
        v = (a @ w[:, 2 * d:] + t[i] * b[2 * d:]).view(n, heads, hd).transpose(0, 1)
        probs = torch.softmax(q @ k.transpose(1, 2) / hd**0.5 + mask, -1).detach()
        h = h + (probs @ v).transpose(0, 1).reshape(n, d) @ att.c_proj.weight + t[i] * att.c_proj.bias
        u = ln(h, block.ln_2, t[i]) @ mlp.c_fc.weight + t[i] * mlp.c_fc.bias
        own.append(u * (_gelu(u) / u).detach())
        h = h + (own[-1] if z is None else z[i]) @ mlp.c_proj.weight + t[i] * mlp.c_proj.bias
    return ln(h, tr.ln_f, t[len(tr.h)]), own


def test_bias_nodes_match_autograd_of_a_hand_written_cut_gpt2():
    model = _model("gpt2", seed=6)
    g = attribution_graph(InMemoryEngine(model), IDS, GraphSettings(max_nodes=50, rows_per_pass=9))
    L, n, M, B = model.config.n_layer, len(IDS), g.n_neurons, g.n_biases
    assert B == L * n + 1 and g.worst_completeness < 1e-12
    x = model.transformer.wte.weight[IDS].clone()
    one = torch.ones(L + 1, dtype=torch.float64)
    _, acts = _cut_gpt2(model, x, None, one)
    assert np.allclose(g.activations, [float(acts[layer][p, i]) for layer, i, p in g.neurons], rtol=1e-12, atol=0)
    per_layer = np.add.reduceat(g.adjacency[:, M:M + B], np.arange(0, B, n), axis=1)  # (size, L + 1)

    def check(row: int, value_of) -> None:
        xs, ts = x.clone().requires_grad_(True), one.clone().requires_grad_(True)
        zs = [a.detach().clone().requires_grad_(True) for a in acts]
        y, own = _cut_gpt2(model, xs, zs, ts)
        value = value_of(y, own)
        gx, gt, *gz = torch.autograd.grad(value, [xs, ts, *zs], allow_unused=True)
        gz = [torch.zeros_like(a) if gr is None else gr for a, gr in zip(acts, gz, strict=True)]
        scale = abs(float(value.detach()))
        want_bias = gt.detach().numpy()  # t_l · ∂value/∂t_l at t = 1: the constants of layer l, every position
        assert np.abs(per_layer[row] - want_bias).max() <= 1e-11 * scale, row
        neurons = [float(acts[layer][p, i] * gz[layer][p, i]) for layer, i, p in g.neurons]
        assert np.abs(g.adjacency[row, :M] - neurons).max() <= 1e-11 * scale
        tokens = (gx * x).sum(-1).detach().numpy()
        assert np.abs(g.adjacency[row, M + B:M + B + n] - tokens).max() <= 1e-11 * scale

    W = model.lm_head.weight
    for k, t in enumerate(g.logit_ids):
        check(M + B + n + k, lambda y, own, t=t: (W[t] - W.mean(0)) @ y[g.position])
    for c in range(0, M, 6):
        layer, i, p = (int(v) for v in g.neurons[c])
        check(c, lambda y, own, layer=layer, i=i, p=p: own[layer][p, i])


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_bias_nodes_vanish_without_biases(family):
    model = _model(family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "wpe" in name:
                p.zero_()
    g = attribution_graph(InMemoryEngine(model), IDS, GraphSettings(max_nodes=30))
    M, B = g.n_neurons, g.n_biases
    assert B > 0 and g.worst_completeness < 1e-12
    assert np.abs(g.adjacency[:, M:M + B]).max() <= 1e-12 * np.abs(g.adjacency).max()


# -- the pullback primitive -----------------------------------------------------------------------------------


def _sweep(engine, trace, requests):
    """Every request's reads at once, ``[{site: cotangents}]``, from the engine's pulls."""
    out = [{} for _ in requests]
    for j, site, values in engine.pulls(trace, requests):
        out[j][site] = values
    return out


def test_neuron_reads_seeds_and_cut_are_refused_on_the_autograd_sweeps():
    engine = InMemoryEngine(_model("llama"), sweeps="autograd")
    assert "neurons" not in engine.pullback_sites and "cut:mlp" not in engine.pullback_sites
    with pytest.raises(InvalidArgumentError, match="neurons.*autograd sweeps were chosen"):
        attribution_graph(engine, IDS, GraphSettings(max_nodes=5))
    trace = engine.trace(IDS)
    u = torch.randn(2, engine.d_model, dtype=torch.float64)
    with pytest.raises(InvalidArgumentError, match="cut:mlp"):
        _sweep(engine, trace, [PullRequest((Seed(OUTPUT, u),), (EMBEDDINGS,), frozenset({"mlp"}))])
    # what the autograd sweeps do honour is the same pullback as the explicit one
    explicit = InMemoryEngine(engine.model)
    got = _sweep(engine, trace, [PullRequest((Seed(OUTPUT, u),), (EMBEDDINGS,))])[0][EMBEDDINGS]
    want = _sweep(explicit, explicit.trace(IDS), [PullRequest((Seed(OUTPUT, u),), (EMBEDDINGS,))])[0][EMBEDDINGS]
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * want.abs().max())


def test_the_streamed_autograd_sweeps_refuse_a_cut_by_name():
    engine = StreamedEngine(_model("llama"), sweeps="autograd")
    trace = engine.trace(IDS)
    u = torch.randn(2, engine.d_model, dtype=torch.float64)
    with pytest.raises(InvalidArgumentError, match="cut:mlp.*autograd sweeps"):
        _sweep(engine, trace, [PullRequest((Seed(OUTPUT, u),), (neurons_of(0),), frozenset({"mlp"}))])


def test_a_malformed_request_names_what_is_wrong():
    engine = InMemoryEngine(_model("llama"))
    trace = engine.trace(IDS)
    u = torch.randn(2, engine.d_model, dtype=torch.float64)
    with pytest.raises(InvalidArgumentError, match="a read at a layer in \\[0, 2\\] for neurons. Got 9"):
        _sweep(engine, trace, [PullRequest((Seed(OUTPUT, u),), (neurons_of(9),))])
    with pytest.raises(InvalidArgumentError, match="every seed with 2 rows"):
        _sweep(engine, trace, [PullRequest((Seed(OUTPUT, u), Seed(OUTPUT, u[:1])), (EMBEDDINGS,))])
    with pytest.raises(InvalidArgumentError, match="d_model"):
        _sweep(engine, trace, [PullRequest((Seed(neurons_of(1), torch.zeros(1, len(IDS), 8)),), (EMBEDDINGS,))])


def test_every_position_pullback_is_the_same_on_both_engines():
    model = _model("llama")
    a, b = InMemoryEngine(model), StreamedEngine(model)
    u = torch.randn(3, a.d_model, dtype=torch.float64)
    got = pull_every_position(a, a.trace(IDS), u, [0, 1])
    want = pull_every_position(b, b.trace(IDS), u, [0, 1])
    for layer in (0, 1):
        assert torch.allclose(got[layer], want[layer], rtol=0, atol=1e-12 * want[layer].abs().max())


# -- bad input -----------------------------------------------------------------------------------------------


def test_bad_settings_and_prompts_are_refused_before_any_work():
    engine = InMemoryEngine(_model("llama"))
    with pytest.raises(InvalidArgumentError, match="max_nodes to be a positive integer. Got 0"):
        attribution_graph(engine, IDS, GraphSettings(max_nodes=0))
    with pytest.raises(InvalidArgumentError, match="logit probability in \\(0, 1\\]. Got 1.5"):
        attribution_graph(engine, IDS, GraphSettings(logit_probability=1.5))
    with pytest.raises(PromptError):
        attribution_graph(engine, [])
    budgeted = StreamedEngine(engine.model, max_memory="cpu=24MiB")  # not all 1,440 neurons' graph
    with pytest.raises(InvalidArgumentError, match="--max-nodes whose graph fits .* Got 7500, .* at most \\d+ fit"):
        attribution_graph(budgeted, IDS)


def test_under_a_budget_the_graph_is_the_same_and_its_passes_are_sized_by_what_the_budget_leaves(monkeypatch):
    from detjac.graphs import build as attribution

    model = _model("llama")
    free = attribution_graph(InMemoryEngine(model), IDS, GraphSettings(max_nodes=40))
    sizes: list[int] = []
    sized = attribution.sized_rows
    monkeypatch.setattr(attribution, "sized_rows", lambda *a: sizes.append(sized(*a)) or sizes[-1])
    roomy = StreamedEngine(model, max_memory="cpu=1GiB")
    own = 2**30 - roomy.sweep_memory(len(IDS))[0]  # the engine's own layer and trace, counted first
    for budget in (own + 2**18, 2**30):  # room for the graph and a few rows; for everything
        g = attribution_graph(StreamedEngine(model, max_memory=f"cpu={budget}B"), IDS, GraphSettings(max_nodes=40))
        assert np.abs(g.adjacency - free.adjacency).max() <= 1e-12 * np.abs(free.adjacency).max()
    assert 1 <= sizes[0] < sizes[1] == 40 + 10  # a small budget: fewer rows a pass; a large one: every row at once
    with pytest.raises(InvalidArgumentError, match="--max-nodes whose graph fits in the cpu budget left .* "
                                                   "Got 2000, .* at most \\d+ fit"):
        attribution_graph(StreamedEngine(model, max_memory=f"cpu={own + 2**18}B"), IDS, GraphSettings(max_nodes=2000))


# -- memory: the graph's whole working set, bounded ------------------------------------------------------------


def _most(error) -> int:
    import re

    return int(re.search(r"at most (\d+) fit", str(error.value))[1])


class _Reached(Exception):
    """The work got past the budget's check to the adjacency's pullbacks."""


def _reached(*args):
    raise _Reached


def test_a_refusal_names_a_number_of_nodes_that_is_then_accepted(monkeypatch):
    from detjac.graphs import build as attribution

    model = _model("llama")
    calls: list[int] = []
    monkeypatch.setattr(attribution, "adjacency", lambda *a: calls.append(1) or _reached())
    with pytest.raises(InvalidArgumentError, match="Got 1000, which needs .* MiB; at most \\d+ fit") as refused:
        attribution_graph(StreamedEngine(model, max_memory="cpu=16MiB"), IDS, GraphSettings(max_nodes=1000))
    most = _most(refused)
    assert 0 < most < 1000 and not calls  # refused before any pullback
    with pytest.raises(_Reached):  # accepted: the work goes on to the adjacency
        attribution_graph(StreamedEngine(model, max_memory="cpu=16MiB"), IDS, GraphSettings(max_nodes=most))
    with pytest.raises(InvalidArgumentError, match=f"Got {most + 1}, .* at most {most} fit"):
        attribution_graph(StreamedEngine(model, max_memory="cpu=16MiB"), IDS, GraphSettings(max_nodes=most + 1))


def test_pruning_holds_no_more_than_the_budget_counts():
    import tracemalloc

    from detjac.graphs import prune, prune_bytes

    rng = np.random.default_rng(0)
    for size in (40, 700):
        adjacency = np.tril(rng.standard_normal((size, size)), -1)
        tracemalloc.start()
        prune(adjacency, size - 15, 10, rng.dirichlet(np.ones(5)))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak <= prune_bytes(size) < 3 * 8 * size * size + 2**20  # ~2 copies, not the ~5 it once held


def test_without_a_budget_the_machine_s_available_memory_bounds_the_graph(monkeypatch):
    from detjac import machine

    monkeypatch.setattr(machine, "available_memory", lambda: 12 * 2**20)
    with pytest.raises(InvalidArgumentError, match="this machine's available memory .* at most \\d+ fit") as refused:
        attribution_graph(InMemoryEngine(_model("llama")), IDS, GraphSettings(max_nodes=10**12))
    assert "Got 1000000000000, which needs" in str(refused.value)
    g = attribution_graph(InMemoryEngine(_model("llama")), IDS, GraphSettings(max_nodes=_most(refused)))
    assert g.n_neurons == _most(refused)


# -- writing a graph -------------------------------------------------------------------------------------------


def test_a_full_disk_keeps_the_computed_graph_and_says_where(tmp_path, monkeypatch):
    import errno
    import json

    from detjac import graph_index
    from detjac.errors import OutputError
    from detjac.graphs import write_graph

    g = attribution_graph(InMemoryEngine(_model("llama")), IDS, GraphSettings(max_nodes=20))
    (tmp_path / "graph-metadata.json").write_text("[" * 100_000 + "]" * 100_000)  # unreadable: started anew
    write_graph(g, tmp_path / "g.json", model="tiny")
    assert [e["slug"] for e in json.loads((tmp_path / "graph-metadata.json").read_text())["graphs"]] == ["g"]

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(graph_index, "write_output", full)
    with pytest.raises(OutputError, match=r"Expected to write the graph to .*h\.json.* Got the disk is full; the graph "
                                          r"is kept in (\S+)\.$") as caught:
        write_graph(g, tmp_path / "h.json", model="tiny")
    kept = str(caught.value).rsplit("kept in ", 1)[1].removesuffix(".")
    try:
        assert json.loads(open(kept).read())["metadata"]["slug"] == "h" and not (tmp_path / "h.json").exists()
    finally:
        os.unlink(kept)
