"""Head loadings of a graph's links (docs/graphs.md, "Head loadings") on tiny random models of every decoder family.

Each crossed layer's loadings plus its skip sum to the link's weight; the loadings equal an independent computation:
autograd of the stock transformers model made into the cut model by test-local code (its softmax in float64 and
detached, a multiplier ``t[l, h]`` on each head's output, every norm in float64 with its scale detached, every MLP's
output detached, plus a handle where a neuron writes), differentiated once for the link's weight and once more in
``t`` (the weight is affine in each ``t[l, h]``, so the derivative at ``t = 1`` is the loading); the streamed engine
gives the same loadings; a written graph's links carry them; bad input is refused before any work.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from tiny_models import FAMILIES
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from detjac.engine import InMemoryEngine, StreamedEngine
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.errors import InvalidArgumentError, UnsupportedModelError
from detjac.graph_settings import GraphSettings
from detjac.graphs import attribution_graph, write_graph

DECODERS = [t for t in FAMILIES if t != "bert"]
IDS = [3, 17, 5, 42, 9, 11]  # longer than a tiny model's sliding window (4)
HEADS = 30  # links loaded per graph
CUT = "detjac_test_cut_heads"
SUM_BOUND = 1e-11  # |heads + skip - weight| / |weight|, per crossed layer
AUTOGRAD_BOUND = 1e-11  # |loading - autograd's| / max(|weight|, max |loading|)
PER_KIND = 2  # links checked by autograd per kind (token or neuron, into a neuron or logit)


def _model(family: str) -> torch.nn.Module:
    model = tiny_model(family, seed=3).to(torch.float64)
    model.requires_grad_(False)
    with torch.no_grad():  # norm weights off their initial values (Gemma's start at 0), biases off 0
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p, generator=torch.Generator().manual_seed(5)))
    return model


_GRAPHS: dict[str, tuple[str, torch.nn.Module, Any]] = {}


def _case(family: str) -> tuple[str, torch.nn.Module, Any]:
    """(family, model, its graph with HEADS links loaded), made once per module."""
    if family not in _GRAPHS:
        model = _model(family)
        graph = attribution_graph(InMemoryEngine(model), IDS, GraphSettings(max_nodes=30, heads=HEADS))
        _GRAPHS[family] = family, model, graph
    return _GRAPHS[family]


@pytest.fixture(scope="module", params=DECODERS)
def case(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, Any]:
    return _case(request.param)


def test_each_crossed_layer_s_heads_and_skip_sum_to_the_link_s_weight(case):
    family, model, g = case
    loaded = g.head_loadings
    L, H = g.n_layers, model.config.get_text_config().num_attention_heads
    assert loaded.loadings.shape == (HEADS, L, H + 1)
    M, B = g.n_neurons, g.n_biases
    for k, (t, s) in enumerate(loaded.links.tolist()):
        weight = g.adjacency[t, s]
        first = int(g.neurons[s, 0]) + 1 if s < M else 0
        top = int(g.neurons[t, 0]) if t < M else L - 1
        crossed = ~np.isnan(loaded.loadings[k, :, 0])
        assert crossed.tolist() == [first <= layer <= top for layer in range(L)], (family, k)
        sums = loaded.loadings[k, crossed].sum(-1)
        assert np.abs(sums - weight).max(initial=0) <= SUM_BOUND * abs(weight), (family, k)
        assert s < M or M + B <= s < M + B + g.n_tokens  # a token or neuron, never a bias node
    weights = np.abs(g.adjacency[loaded.links[:, 0], loaded.links[:, 1]])
    assert (np.diff(weights) <= 0).all()  # strongest first
    assert g.info["head_loadings_error"] <= SUM_BOUND


# -- the independent computation: the stock model made into the cut model by test-local code -------------------


def _frozen_norm(module: torch.nn.Module) -> Any:
    """A norm's forward in float64 with its scale detached (Gemma's RMSNorm: weight ``1 + w``; a LayerNorm centres
    and adds its bias)."""
    if isinstance(module, torch.nn.LayerNorm):
        def layer_norm(x: torch.Tensor) -> torch.Tensor:
            c = x - x.mean(-1, keepdim=True)
            return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + module.eps).detach() * module.weight + \
                module.bias
        return layer_norm
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    offset = 1.0 if type(module).__name__.startswith("Gemma") else 0.0
    return lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps).detach() * (offset + module.weight)


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The text decoder (a multimodal Gemma 3's language model)."""
    base = getattr(model, "model", None) or model.transformer
    return getattr(base, "language_model", base)


def _mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    decoder = _decoder(model)
    return [layer.mlp for layer in getattr(decoder, "layers", None) or decoder.h]


def _cut_run(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, writes: dict[int, torch.Tensor]
             ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The cut model on embeddings ``x`` (n, d) with head multipliers ``t`` (L, heads) and ``writes[l]`` (n, d) added
    to layer l's MLP output: (final normed state (n, d), each MLP's input (n, d) by layer)."""
    def attention(module: Any, query: Any, key: Any, value: Any, mask: Any, scaling: Any = None, softcap: Any = None,
                  **_: Any) -> Any:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scores = query @ key.transpose(2, 3) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores + mask[:, :, :, : key.shape[-2]], dim=-1).detach()
        out = (probs @ value) * t[module.layer_idx][None, :, None, None]  # (1, heads, n, hd): each head's output
        return out.transpose(1, 2).contiguous(), probs

    AttentionInterface.register(CUT, attention)
    AttentionMaskInterface.register(CUT, eager_mask)
    norms = [m for m in _decoder(model).modules() if type(m).__name__.endswith("RMSNorm") or
             isinstance(m, torch.nn.LayerNorm)]
    mlps = _mlps(model)
    inputs: dict[int, torch.Tensor] = {}

    def held(layer: int) -> Any:
        def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
            inputs[layer] = args[0][0]
            return output.detach() + writes.get(layer, 0)
        return hook

    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                             "_attn_implementation")}.values()
    before = [(c, c._attn_implementation) for c in configs]
    handles = [mlp.register_forward_hook(held(i)) for i, mlp in enumerate(mlps)]
    try:
        for m in norms:
            m.forward = _frozen_norm(m)
        for c, _ in before:
            c._attn_implementation = CUT
        hidden = _decoder(model)(inputs_embeds=x[None], use_cache=False).last_hidden_state[0]
    finally:
        for h in handles:
            h.remove()
        for m in norms:
            del m.forward
        for c, impl in before:
            c._attn_implementation = impl
    return hidden, inputs


def _logit(model: torch.nn.Module, y: torch.Tensor, token: int) -> torch.Tensor:
    """The demeaned logit of ``token`` from the final normed state ``y`` (d,), a final soft-cap's ratio frozen."""
    raw = model.get_output_embeddings().weight @ y
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap:
        raw = raw * (torch.tanh(raw / cap) * cap / raw).detach()
    return raw[token] - raw.mean()


def _write_row(model: torch.nn.Module, layer: int, index: int) -> torch.Tensor | None:
    """What neuron ``index`` of ``layer`` writes per unit of its value into the MLP's output (None: a mixture of
    experts, not written here)."""
    mlp = _mlps(model)[layer]
    down = getattr(mlp, "down_proj", None)
    if down is not None:
        return down.weight[:, index]
    c_proj = getattr(mlp, "c_proj", None)  # GPT-2's Conv1D: (ffn, d)
    return None if c_proj is None else c_proj.weight[index]


def _neuron_value(model: torch.nn.Module, m: torch.Tensor, layer: int, index: int, pos: int) -> torch.Tensor | None:
    """A gated MLP's neuron from its input ``m`` (n, d), gate frozen: ``act(gate(m)) · up(m)`` (None: another MLP)."""
    mlp = _mlps(model)[layer]
    if not hasattr(mlp, "gate_proj") or not hasattr(mlp, "up_proj"):
        return None
    gate = mlp.act_fn(m[pos] @ mlp.gate_proj.weight[index]).detach()
    return gate * (m[pos] @ mlp.up_proj.weight[index])


def test_loadings_equal_autograd_of_the_stock_model_made_into_the_cut_model(case):
    family, model, g = case
    loaded, M, B, n, L = g.head_loadings, g.n_neurons, g.n_biases, g.n_tokens, g.n_layers
    H = model.config.get_text_config().num_attention_heads
    x = model.get_input_embeddings()(torch.tensor(IDS)).detach()
    checked = {"token": 0, "neuron": 0, "into a neuron": 0}
    seen: dict[tuple[bool, bool], int] = {}
    for k, (target, source) in enumerate(loaded.links.tolist()):
        kind = (source < M, target < M)
        if seen.get(kind, 0) == PER_KIND:
            continue
        t = torch.ones(L, H, dtype=torch.float64, requires_grad=True)
        xs = x.clone().requires_grad_(True)
        handle = torch.zeros(n, x.shape[1], dtype=torch.float64, requires_grad=True)
        if source < M:
            layer, index, pos = (int(v) for v in g.neurons[source])
            row = _write_row(model, layer, index)
            if row is None:
                continue
            writes = {layer: handle}
        else:
            writes = {}
        y, inputs = _cut_run(model, xs, t, writes)
        if target < M:
            tl, ti, tp = (int(v) for v in g.neurons[target])
            value = _neuron_value(model, inputs[tl], tl, ti, tp)
            if value is None:
                continue
            assert abs(value.item() - g.activations[target]) <= 1e-10 * abs(g.activations[target])
        else:
            value = _logit(model, y[g.position], g.logit_ids[target - M - B - n])
        if source < M:
            (grad,) = torch.autograd.grad(value, handle, create_graph=True)
            weight = g.activations[source] * grad[pos] @ row
        else:
            (grad,) = torch.autograd.grad(value, xs, create_graph=True)
            p = source - M - B
            weight = grad[p] @ xs[p]
        assert abs(weight.item() - g.adjacency[target, source]) <= 1e-10 * abs(weight.item())
        dt = torch.autograd.grad(weight, t, allow_unused=True)[0] if weight.requires_grad else None
        dt = torch.zeros(L, H, dtype=torch.float64) if dt is None else dt  # no head between them
        crossed = ~np.isnan(loaded.loadings[k, :, 0])
        got = np.nan_to_num(loaded.loadings[k, :, :H])
        scale = max(abs(weight.item()), np.abs(got).max())
        assert np.abs(got - dt.numpy()).max() <= AUTOGRAD_BOUND * scale, (family, k)
        assert not dt.numpy()[~crossed].any()  # a layer not crossed carries nothing
        seen[kind] = seen.get(kind, 0) + 1
        checked["token" if source >= M else "neuron"] += 1
        checked["into a neuron"] += target < M
    assert checked["token"] >= 1, (family, checked)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "olmo2"])  # its walk is the same code for all
def test_the_streamed_engine_under_a_budget_gives_the_same_loadings(family):
    _, model, g = _case(family)
    s = attribution_graph(StreamedEngine(model, max_memory="cpu=1GiB"), IDS, GraphSettings(max_nodes=30, heads=HEADS))
    assert np.array_equal(s.head_loadings.links, g.head_loadings.links)
    a, b = g.head_loadings.loadings, s.head_loadings.loadings
    assert np.array_equal(np.isnan(a), np.isnan(b))
    assert np.nanmax(np.abs(a - b)) <= 1e-12 * np.nanmax(np.abs(a))


def test_one_target_per_block_gives_the_same_loadings(monkeypatch):
    _, model, g = _case("gemma2")
    from detjac.graphs import head_loadings

    monkeypatch.setattr(head_loadings, "HEAD_BLOCK_BYTES", 1)  # every target its own pullback and push
    one = attribution_graph(InMemoryEngine(model), IDS, GraphSettings(max_nodes=30, heads=HEADS)).head_loadings.loadings
    a = g.head_loadings.loadings
    assert np.array_equal(np.isnan(a), np.isnan(one))
    assert np.nanmax(np.abs(a - one)) <= 1e-12 * np.nanmax(np.abs(a))


def test_a_written_graph_s_links_carry_their_loadings(tmp_path):
    _, model, g = _case("llama")
    data = write_graph(g, tmp_path / "g.json", model="tiny")
    assert json.loads((tmp_path / "g.json").read_text()) == data
    loaded = [link for link in data["links"] if "head_loadings" in link]
    assert len(loaded) == HEADS
    H = model.config.get_text_config().num_attention_heads
    for link in loaded:
        for layer, row in link["head_loadings"].items():
            assert list(row) == [*map(str, range(H)), "skip"]
            assert abs(sum(row.values()) - link["weight"]) <= SUM_BOUND * abs(link["weight"]), layer
    strongest = sorted((abs(link["weight"]) for link in data["links"] if link["source"][0] != "B"), reverse=True)
    assert sorted(abs(link["weight"]) for link in loaded)[0] == strongest[HEADS - 1]


def test_bad_heads_are_refused():
    _, model, g = _case("llama")
    engine = InMemoryEngine(model)
    with pytest.raises(InvalidArgumentError, match=r"Expected --heads to be a non-negative integer.*Got -1"):
        attribution_graph(engine, IDS, GraphSettings(max_nodes=30, heads=-1))
    with pytest.raises(InvalidArgumentError, match=r"Expected --heads at most the pruned graph's \d+ links"):
        attribution_graph(engine, IDS, GraphSettings(max_nodes=30, heads=10**6))
    with pytest.raises(UnsupportedModelError, match="post-norm"):
        attribution_graph(InMemoryEngine(_model_bert()), IDS, GraphSettings(max_nodes=5, heads=3))


def _model_bert() -> torch.nn.Module:
    return tiny_model("bert", seed=3).to(torch.float64)


def test_links_into_the_logits_only_carry_the_same_loadings():
    _, model, g = _case("mistral")
    settings = GraphSettings(max_nodes=30, heads=6, heads_into="logits")
    into = attribution_graph(InMemoryEngine(model), IDS, settings).head_loadings
    first_logit = g.n_neurons + g.n_biases + g.n_tokens
    assert (into.links[:, 0] >= first_logit).all() and len(into.links) == 6
    rows = {tuple(link): k for k, link in enumerate(g.head_loadings.links.tolist())}
    shared = [(k, rows[tuple(link)]) for k, link in enumerate(into.links.tolist()) if tuple(link) in rows]
    assert shared  # the strongest links into the logits are among the graph's strongest here
    for k, j in shared:
        a, b = into.loadings[k], g.head_loadings.loadings[j]
        assert np.array_equal(np.isnan(a), np.isnan(b)) and np.nanmax(np.abs(a - b)) <= 1e-12 * np.nanmax(np.abs(b))
    with pytest.raises(InvalidArgumentError, match="Expected --heads-into among all, logits. Got 'tokens'"):
        attribution_graph(InMemoryEngine(model), IDS, GraphSettings(max_nodes=30, heads=6, heads_into="tokens"))


def test_the_strongest_heads_into_a_target_are_its_links_loadings_summed():
    """What `detjac graph --heads` prints: per head, the loadings of the loaded links into the target summed; the
    skip never ranked; links into other targets ignored."""
    from detjac.graphs import HeadLoadings, strongest_heads

    nan = np.nan
    loadings = np.array([[[0.5, -0.1, 0.6], [nan, nan, nan]],  # link 0 into 9 crosses layer 0 only
                         [[0.25, -2.0, 0.0], [0.3, 0.0, 0.1]],  # link 1 into 9
                         [[9.0, 9.0, 9.0], [9.0, 9.0, 9.0]]])  # link 2 into another target
    loaded = HeadLoadings(np.array([[9, 1], [9, 2], [8, 1]]), loadings, 0.0)
    adjacency = np.zeros((10, 10))
    adjacency[9, 1], adjacency[9, 2] = 1.0, 0.65
    links, weight, heads = strongest_heads(loaded, adjacency, 9, top=3)
    assert (links, weight) == (2, pytest.approx(1.65))
    assert heads == [(0, 1, pytest.approx(-2.1)), (0, 0, pytest.approx(0.75)), (1, 0, pytest.approx(0.3))]
    assert strongest_heads(loaded, adjacency, 3) == (0, 0.0, [])
