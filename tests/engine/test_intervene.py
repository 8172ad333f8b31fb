"""Interventions on a node (docs/graphs.md, "Interventions") on tiny random float64 models of every decoder family.

Two independent computations per column: the linear column (the frozen system run with its factors replayed) equals
the prompt's output plus the edit's change pushed through the detached Jacobian, here by autograd of the linearized
model in a scalar ``t`` that moves the edited value (the frozen system is affine in it); the real column equals a stock
forward with a hand-written hook. A clamp to the current value changes nothing; bad edits are refused before any
forward runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import FAMILIES

from detjac.engine import Edit, InMemoryEngine, intervene
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.engine.detach.model import linearized
from detjac.engine.products.logits import output_logits
from detjac.errors import InvalidArgumentError, UnsupportedModelError

DECODERS = [t for t in FAMILIES if t != "bert"]
MOE = ("qwen3_moe", "mixtral", "olmoe")
IDS = [3, 17, 5, 42, 9, 11]  # longer than a tiny model's sliding window (4)
BOUND = 1e-12  # |logits - independent| / max |logits|


def _model(family: str) -> torch.nn.Module:
    model = tiny_model(family, seed=3).to(torch.float64)
    model.requires_grad_(False)
    with torch.no_grad():  # norm weights off their initial values (Gemma's start at 0)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p, generator=torch.Generator().manual_seed(5)))
    return model


_ENGINES: dict[str, InMemoryEngine] = {}


@pytest.fixture(scope="module", params=DECODERS)
def engine(request: pytest.FixtureRequest) -> InMemoryEngine:
    if request.param not in _ENGINES:
        _ENGINES[request.param] = InMemoryEngine(_model(request.param))
    return _ENGINES[request.param]


# -- the sites, written here by hand from transformers' module names ------------------------------------------------


def _layer(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    base = getattr(model, "model", None) or model.transformer
    base = getattr(base, "language_model", base)
    return (getattr(base, "layers", None) or base.h)[layer]


def _site(model: torch.nn.Module, e: Edit) -> tuple[torch.nn.Module, slice]:
    """(the module whose input the edit replaces, the columns) for a neuron (the MLP's down projection) or a head
    (the attention's output projection, ``head_dim`` columns per head)."""
    block = _layer(model, e.layer)
    if e.kind == "neuron":
        mlp = getattr(block.mlp, "inner", block.mlp)  # inside linearized(): the wrapped MLP
        return getattr(mlp, "down_proj", None) or mlp.c_proj, slice(e.index, e.index + 1)
    attention = getattr(block, "self_attn", None) or block.attn
    out = getattr(attention, "o_proj", None) or attention.c_proj
    hd = (getattr(out, "in_features", None) or out.nx) // model.config.get_text_config().num_attention_heads
    return out, slice(e.index * hd, (e.index + 1) * hd)


def _hooked(model: torch.nn.Module, edits: list[Edit], change: Any) -> list[Any]:
    """Pre-hooks: ``change(k, x_cols)`` returns edit k's new columns (1, width) at its position, or None to keep."""
    handles = []
    for k, e in enumerate(edits):
        module, cols = _site(model, e)

        def hook(m: Any, args: tuple[Any, ...], k: int = k, e: Edit = e, cols: slice = cols) -> Any:
            new = change(k, args[0][0, :, cols])
            if new is None:
                return None
            x = args[0].clone()
            x[0, e.position, cols] = new
            return (x, *args[1:])
        handles.append(module.register_forward_pre_hook(hook))
    return handles


def _values(model: torch.nn.Module, edits: list[Edit], run: Any) -> list[torch.Tensor]:
    """Each edit's site values on the prompt (n, width) as ``run()`` computes them."""
    seen: list[torch.Tensor] = [torch.empty(0)] * len(edits)

    def keep(k: int, x: torch.Tensor) -> None:
        seen[k] = x.detach().clone()

    handles = _hooked(model, edits, keep)
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


def _target(e: Edit, x: torch.Tensor) -> torch.Tensor:
    """The value (width,) the edit sets, from its site's values ``x`` (n, width)."""
    if e.mode == "zero":
        return torch.zeros_like(x[0])
    if e.mode == "mean":
        return x.mean(0)
    return torch.as_tensor(e.value, dtype=x.dtype).reshape(-1).expand(x.shape[1])


def _stock(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([IDS]), use_cache=False).logits[0, -1]


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _linear_by_autograd(model: torch.nn.Module, edits: list[Edit]) -> torch.Tensor:
    """The frozen system's logits with ``edits``: the prompt's output plus ``d/dt`` of the linearized model's output
    at ``t = 0``, where each edited value moves by ``t`` times (new value - current value). Valid for edits that do
    not feed one another (one layer)."""
    with linearized(model) as lin:
        def run(t: torch.Tensor | None = None) -> torch.Tensor:
            return lin.decoder(input_ids=torch.tensor([IDS]), use_cache=False).last_hidden_state[0, -1]

        current = _values(model, edits, run)
        news = [_target(e, x) for e, x in zip(edits, current, strict=True)]

        def moved(t: torch.Tensor) -> torch.Tensor:
            handles = _hooked(model, edits, lambda k, x: x[edits[k].position] + t * (news[k] - x[edits[k].position]))
            try:
                return run()
            finally:
                for h in handles:
                    h.remove()

        zero = torch.zeros((), dtype=torch.float64)
        h0 = moved(zero).detach()
        dh = torch.autograd.functional.jacobian(moved, zero)  # (d,)
    return output_logits(model, h0 + dh)


def _real_by_hook(model: torch.nn.Module, edits: list[Edit]) -> torch.Tensor:
    current = _values(model, edits, lambda: _stock(model))
    news = [_target(e, x) for e, x in zip(edits, current, strict=True)]
    handles = _hooked(model, edits, lambda k, x: news[k])
    try:
        return _stock(model)
    finally:
        for h in handles:
            h.remove()


def _edits(family: str) -> list[list[Edit]]:
    heads = [[Edit("head", 1, 2, 4, "mean")], [Edit("head", 0, 1, 5, "clamp", 0.7)],
             [Edit("head", 2, 3, 2, "zero"), Edit("head", 2, 0, 5, "clamp", [0.1 * i for i in range(8)])]]
    if family in MOE:
        return heads
    return heads + [[Edit("neuron", 1, 7, 5, "clamp", 3.0)], [Edit("neuron", 2, 11, 5, "zero")],
                    [Edit("neuron", 0, 5, 2, "mean"), Edit("neuron", 0, 9, 5, "zero")]]


def _fit(model: torch.nn.Module, group: list[Edit]) -> list[Edit]:
    """``group`` with a head's vector clamp sized to this model's head_dim."""
    out = []
    for e in group:
        if isinstance(e.value, list):
            _, cols = _site(model, e)
            e = Edit(e.kind, e.layer, e.index, e.position, e.mode, [0.1 * i for i in range(cols.stop - cols.start)])
        out.append(e)
    return out


def test_the_linear_column_is_the_frozen_system_and_the_real_column_the_stock_model(engine):
    model, family = engine.model, engine.config.model_type
    for group in _edits(family):
        group = _fit(model, group)
        got = intervene(engine, IDS, group, top_k=5)
        assert _close(got.logits["linear"], _linear_by_autograd(model, group)) <= BOUND, (family, group)
        assert _close(got.logits["real"], _real_by_hook(model, group)) <= BOUND, (family, group)
        assert _close(got.logits["linear"], got.logits["frozen_before"]) > 1e-6, (family, group)  # it moved
        top = torch.topk(got.logits["linear"], 5)
        assert got.linear.token_ids == top.indices.tolist()
        probs = torch.softmax(got.logits["linear"], -1)[top.indices]
        assert got.linear.probabilities == pytest.approx(probs.tolist(), rel=1e-12)
        t = got.target
        assert got.real.target_change == pytest.approx(float(got.logits["real"][t] - got.logits["before"][t]),
                                                       rel=1e-12)


def test_a_clamp_to_the_current_value_changes_nothing(engine):
    model = engine.model
    edits = [Edit("head", 1, 2, 4)] + ([] if engine.config.model_type in MOE else [Edit("neuron", 2, 7, 3)])
    with linearized(model) as lin:
        frozen = _values(model, edits, lambda: lin.decoder(input_ids=torch.tensor([IDS]), use_cache=False))
    real = _values(model, edits, lambda: _stock(model))
    for values, column in ((frozen, "linear"), (real, "real")):
        clamps = [Edit(e.kind, e.layer, e.index, e.position, "clamp", v[e.position].tolist())
                  for e, v in zip(edits, values, strict=True)]
        clamps = [Edit(c.kind, c.layer, c.index, c.position, c.mode, c.value[0] if c.kind == "neuron" else c.value)
                  for c in clamps]
        got = intervene(engine, IDS, clamps, top_k=3)
        base = got.logits["frozen_before" if column == "linear" else "before"]
        assert _close(got.logits[column], base) <= BOUND, (engine.config.model_type, column)


@pytest.mark.parametrize(("edit", "words"), [
    (Edit("neuron", 3, 0, 0), "layer in [0, 3)"),
    (Edit("neuron", 0, 48, 0), "neuron in [0, 48)"),
    (Edit("head", 0, 4, 0), "head in [0, 4)"),
    (Edit("head", 0, 0, 6), "position in [0, 6)"),
    (Edit("head", 0, 0, -1), "position in [0, 6)"),
    (Edit("node", 0, 0, 0), "edit kind among neuron, head"),
    (Edit("head", 0, 0, 0, "scale"), "edit mode among zero, mean, clamp"),
    (Edit("neuron", 0, 0, 0, "clamp"), "Expected a number to clamp"),
    (Edit("head", 0, 0, 0, "clamp", [1.0, 2.0]), "8 numbers"),
    (Edit("neuron", 0, 0, 0, "zero", 1.0), "Expected no value"),
])
def test_bad_edits_are_refused_before_any_forward(edit, words):
    engine = InMemoryEngine(tiny_model("llama", seed=3))
    runs = []
    handle = engine.model.register_forward_pre_hook(lambda m, a: runs.append(1))
    try:
        with pytest.raises(InvalidArgumentError, match="Expected") as err:
            intervene(engine, IDS, [edit])
    finally:
        handle.remove()
    assert words in str(err.value) and "Got" in str(err.value)
    assert runs == []


def test_no_edit_a_bad_top_k_and_moe_neurons_are_refused():
    engine = InMemoryEngine(tiny_model("llama", seed=3))
    with pytest.raises(InvalidArgumentError, match="at least one edit. Got none"):
        intervene(engine, IDS, [])
    with pytest.raises(InvalidArgumentError, match=r"top_k in \[1, 160\]. Got 0"):
        intervene(engine, IDS, [Edit("head", 0, 0, 0)], top_k=0)
    moe = InMemoryEngine(tiny_model("qwen3_moe", seed=3))
    with pytest.raises(UnsupportedModelError, match="Expected a dense MLP for a neuron edit"):
        intervene(moe, IDS, [Edit("neuron", 0, 0, 0)])
