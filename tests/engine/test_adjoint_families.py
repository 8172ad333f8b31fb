"""The in-memory engine's explicit sweeps (every family's frozen pieces as plain matmuls) equal its autograd path.

The layer-streamed engine's explicit sweeps are held to its autograd sweeps for every streamable family in
test_adjoint.py; here every family of engine/families (tiny_models.py), every detach convention, goes through
the in-memory engine both ways: rows, J^T u and J v, and the float64 reconstruction with the explicit rows.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from tiny_models import FAMILIES
from torch import nn

from detjac.engine import assemble
from detjac.engine.checkpoints.tiny import tiny_config, tiny_model
from detjac.engine.detach.model import linearized
from detjac.engine.families import family_for
from detjac.engine.inmemory import model_pieces as frozen_module
from detjac.engine.inmemory.inmemory_engine import InMemoryEngine
from detjac.engine.pieces import NotAPiece
from detjac.engine.pieces.layer import check_layer
from detjac.engine.pieces.runner import SWEEPS_ENV
from detjac.engine.result import reconstruct
from detjac.errors import InvalidArgumentError
from detjac.exactness import relative_error
from detjac.targets import DEFAULT_ROW_BLOCK, OUTPUTS

EXACT = 1e-12
CASES = [(t, c) for t in FAMILIES for c in family_for(tiny_config(t)).conventions]


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |difference|, relative to the largest entry (at least 1)."""
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


@pytest.mark.parametrize(("model_type", "convention"), CASES, ids=[f"{t}-{c}" for t, c in CASES])
def test_explicit_in_memory_sweeps_equal_autograd_for_every_family(model_type: str, convention: str,
                                                                   prompt_ids: list[int]) -> None:
    model = tiny_model(model_type, seed=7)
    ref = InMemoryEngine(model, sweeps="autograd", convention=convention)
    ours = InMemoryEngine(model, sweeps="explicit", convention=convention)
    position = 2 if ref.family.encoder else -1  # an encoder's position reads every token; a causal one all before it
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to torch.func fails the test
        trace, J = _traced(ours, prompt_ids, position)
    assert trace.frozen is not None and trace.pullback is None  # the explicit path was taken
    assert ours.stats.explicit_layers == ours.n_layers * -(-ours.d_model // DEFAULT_ROW_BLOCK)
    ref_trace, J_ref = _traced(ref, prompt_ids, position)
    assert ref_trace.frozen is None and ref.stats.explicit_layers == 0
    assert _close(J, J_ref) <= EXACT
    assert torch.equal(trace.output, ref_trace.output)
    assert (trace.bias is None) == (ref_trace.bias is None) == (not ref.family.affine)
    if trace.bias is not None:
        assert _close(trace.bias, ref_trace.bias) <= EXACT
    assert relative_error(reconstruct(J, trace.embeddings, trace.bias), trace.output) < EXACT
    gen = torch.Generator().manual_seed(5)
    u = torch.randn(5, ours.d_model, generator=gen, dtype=torch.float64)
    v = torch.randn(5, len(prompt_ids), ours.d_model, generator=gen, dtype=torch.float64)
    got_pull, got_push = ours.pull(trace, u), ours.push(trace, v)
    assert _close(got_pull, ref.pull(ref_trace, u)) <= EXACT
    assert _close(got_push, ref.push(ref_trace, v)) <= EXACT
    assert torch.allclose((u * got_push).sum(), (got_pull * v).sum(), rtol=1e-12, atol=0)  # <u, Jv> = <J^T u, v>



def _traced(engine: InMemoryEngine, prompt_ids: list[int], position: int | None = None) -> tuple[Any, torch.Tensor]:
    """The engine's trace of the prompt (its pieces or pullback) and the output's whole Jacobian from it."""
    trace = engine.trace(prompt_ids, position=position)
    return trace, assemble(engine, trace, [OUTPUTS], engine.plan(trace, [OUTPUTS]))[OUTPUTS]

def test_an_unknown_piece_falls_back_to_autograd_once_and_stays_exact(prompt_ids: list[int]) -> None:
    model = tiny_model("llama", seed=4)
    ref_trace, J_ref = _traced(InMemoryEngine(model, sweeps="autograd"), prompt_ids)
    model.model.layers[1].mlp = nn.Sequential(model.model.layers[1].mlp)  # a container the pieces do not know
    engine = InMemoryEngine(model, sweeps="explicit")
    with pytest.warns(RuntimeWarning, match="layer 1: mlp: Sequential is not a known piece") as record:
        trace, J = _traced(engine, prompt_ids)
        engine.trace(prompt_ids)  # a second prompt: said once per engine
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    assert trace.frozen is None and engine.stats.explicit_layers == 0
    assert _close(J, J_ref) <= EXACT


def test_the_ordinary_jacobian_goes_through_autograd_silently(prompt_ids: list[int]) -> None:
    model = tiny_model("gpt2", seed=2)
    engine = InMemoryEngine(model, detach=False, sweeps="explicit")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trace = engine.trace(prompt_ids)
    assert trace.frozen is None and trace.pullback is not None


def test_in_memory_sweeps_are_chosen_by_option_or_environment(monkeypatch: pytest.MonkeyPatch,
                                                              prompt_ids: list[int]) -> None:
    model = tiny_model("mixtral", seed=0)
    assert InMemoryEngine(model).trace(prompt_ids).frozen is not None  # the default: explicit
    monkeypatch.setenv(SWEEPS_ENV, "autograd")
    assert InMemoryEngine(model).trace(prompt_ids).frozen is None
    assert InMemoryEngine(model, sweeps="explicit").sweeps == "explicit"  # the option wins
    with pytest.raises(InvalidArgumentError, match="Expected sweeps one of explicit, autograd. Got 'vmap'"):
        InMemoryEngine(model, sweeps="vmap")


@pytest.mark.parametrize(("model_type", "spoil"), [
    # W + c 11^T is W once centred: the folded value projection without the centring (ln_1's) in it
    ("gpt2", lambda p: setattr(p.attention, "value", p.attention.value + 0.1)),
    ("bert", lambda p: setattr(p, "attention_norm", None)),  # a post-norm left out
    ("qwen2", lambda p: setattr(p.attention, "out", p.attention.out * 1.01)),
    ("mixtral", lambda p: p.mlp.experts.pop()),  # an expert's positions left out
    ("olmoe", lambda p: setattr(p.mlp.experts[0], "gate", p.mlp.experts[0].gate.flip(0))),  # rows mixed up
])
def test_new_pieces_rebuild_their_layer_and_spoiled_ones_do_not(model_type: str, spoil, prompt_ids: list[int],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple] = []

    def checked(pieces, h, out, mid):
        seen.append((pieces, h, out, mid))
        return check_layer(pieces, h, out, mid)

    monkeypatch.setattr(frozen_module, "check_layer", checked)
    model = tiny_model(model_type, seed=3)
    with linearized(model) as lin:
        x = lin.decoder.get_input_embeddings()(torch.tensor([prompt_ids]))[0]
        got, _, _ = frozen_module.freeze_model(lin, x, 0)
    assert isinstance(got, frozen_module.FrozenModel)
    assert len(seen) == model.config.num_hidden_layers
    pieces, h, out, mid = seen[0]
    assert check_layer(pieces, h, out, mid) is None
    spoil(pieces)
    with pytest.raises(NotAPiece, match="with relative error"):
        check_layer(pieces, h, out, mid)
