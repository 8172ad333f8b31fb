"""The explicit sweeps (a layer's frozen pieces as plain matmuls) equal the autograd sweeps (torch.func)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from tiny_models import swept

from detjac.engine import load_model
from detjac.engine.checkpoints.tiny import save_tiny_checkpoint, tiny_model
from detjac.engine.detach.model import linearized
from detjac.engine.pieces import NotAPiece
from detjac.engine.pieces import layer as pieces
from detjac.engine.pieces.layer import check_layer
from detjac.engine.pieces.record import record_layer
from detjac.engine.pieces.runner import SWEEPS_ENV
from detjac.engine.streamed.adjoint import ExplicitAdjoint
from detjac.engine.streamed.streamed_engine import StreamedEngine
from detjac.errors import InvalidArgumentError
from detjac.targets import COMPONENTS, LOCAL_SUFFIX, TO_OUTPUT, layer_targets

ALL_COMPONENTS = ",".join([*COMPONENTS, *(f"{c}{LOCAL_SUFFIX}" for c in COMPONENTS if c != TO_OUTPUT)])
EXACT = 1e-12


def _worst(a: dict, b: dict) -> float:
    """Largest |difference| of two results' Jacobians, relative to each one's largest entry (at least 1)."""
    return max((a[t] - b[t]).abs().max().item() / max(1.0, a[t].abs().max().item()) for t in a.jacobians)


@contextmanager
def _no_fallback() -> Iterator[None]:
    """A fallback to torch.func (a RuntimeWarning) fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


def _sweeps(engine: StreamedEngine, prompt_ids: list[int]) -> list:
    """Every target, both modes, two positions: the reverse sweeps at the last token and at one before the sliding
    windows' reach, then the forward sweep of the cumulative targets."""
    targets = ["output", *(t.name for t in layer_targets("all", ALL_COMPONENTS, engine.n_layers))]
    cumulative = [t for t in targets if LOCAL_SUFFIX not in t and TO_OUTPUT not in t]
    with _no_fallback():
        return [*(swept(engine, prompt_ids, targets, mode="reverse", row_block=9, position=position)
                  for position in (-1, 5)),
                swept(engine, prompt_ids, cumulative, mode="forward", token_block=3, position=7)]


def _by_autograd(model: torch.nn.Module, prompt_ids: list[int], **options: object) -> tuple[StreamedEngine, list]:
    ref = StreamedEngine(model, sweeps="autograd", **options)
    return ref, _sweeps(ref, prompt_ids)


def _agree(model: torch.nn.Module, prompt_ids: list[int], reference: tuple | None = None,
           **options: object) -> StreamedEngine:
    """The explicit sweeps equal the autograd sweeps (``reference``, computed here when not given) for every
    target, both modes, two positions (no fallback)."""
    ref, want = reference if reference is not None else _by_autograd(model, prompt_ids, **options)
    ours = StreamedEngine(model, sweeps="explicit", **options)
    got = _sweeps(ours, prompt_ids)
    for a, b, where in zip(want, got, ("position -1", "position 5", "forward"), strict=True):
        assert _worst(a, b) <= EXACT, where
    for t in got[-1].jacobians:
        assert got[-1].reconstruction_error(t) < EXACT, t.name
    assert ours.stats.explicit_layers > 0 and ref.stats.explicit_layers == 0
    # the same truncations as the autograd sweeps: suffix pullbacks at the top, suffix pushes up the token blocks
    assert ours.stats.pulled_suffix_layers == ref.stats.pulled_suffix_layers > 0
    assert ours.stats.suffix_layers == ref.stats.suffix_layers > 0
    return ours


@pytest.fixture(scope="module")
def qwen3_by_autograd(prompt_ids: list[int]) -> tuple[torch.nn.Module, tuple]:
    """The model of the few-rows tests and its autograd sweeps: one reference for both chunkings (the chunk size is
    the explicit pieces' setting; the autograd sweeps do not read it)."""
    model = tiny_model("qwen3", seed=6)
    return model, _by_autograd(model, prompt_ids)


def test_explicit_sweeps_equal_autograd_for_every_family_target_and_mode(streamable_model: torch.nn.Module,
                                                                          prompt_ids: list[int]) -> None:
    _agree(streamable_model, prompt_ids)


def test_explicit_sweeps_equal_autograd_in_the_gate_convention(prompt_ids: list[int]) -> None:
    ours = _agree(tiny_model("phi3", seed=7), prompt_ids, convention="gate")
    assert ours.convention == "gate"


@pytest.mark.parametrize("rows", [5, 26])
def test_a_gated_mlp_made_a_few_rows_at_a_time_stays_exact(monkeypatch: pytest.MonkeyPatch, prompt_ids: list[int],
                                                           rows: int, qwen3_by_autograd: tuple) -> None:
    # 5 rows: a few positions of one vector at a time (a long prompt); 26: two whole vectors at a time (plus the top
    # layer's one position per vector, many vectors per chunk)
    monkeypatch.setattr(pieces, "CHUNK_BYTES", {"cpu": 1})
    monkeypatch.setattr(pieces, "MIN_CHUNK_ROWS", rows)
    assert rows < len(prompt_ids) or rows // len(prompt_ids) == 2
    model, reference = qwen3_by_autograd
    _agree(model, prompt_ids, reference)


@pytest.mark.parametrize("model_type", ["gemma3_text", "phi3"])
def test_explicit_products_equal_autograd_from_memory_and_from_safetensors(
        tmp_path: Path, model_type: str, prompt_ids: list[int]) -> None:
    folder = save_tiny_checkpoint(tmp_path / model_type, model_type, seed=3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    u = torch.randn(6, 32, generator=gen, dtype=torch.float64)
    v = torch.randn(6, len(prompt_ids), 32, generator=gen, dtype=torch.float64)
    for source in (load_model(folder, dtype=torch.float64), folder):  # weights in memory, or streamed from shards
        ref = StreamedEngine(source, sweeps="autograd")
        tr = ref.trace(prompt_ids)
        want_pull, want_push = ref.pull(tr, u), ref.push(tr, v)
        sm = StreamedEngine(source, sweeps="explicit")
        t = sm.trace(prompt_ids)
        got_pull, got_push = sm.pull(t, u), sm.push(t, v)
        assert (got_pull - want_pull).abs().max().item() <= EXACT * max(1.0, want_pull.abs().max().item())
        assert (got_push - want_push).abs().max().item() <= EXACT * max(1.0, want_push.abs().max().item())
        assert sm.stats.explicit_layers == 2 * sm.n_layers
        # J^T and J are each other's transposes: <u, J v> = <J^T u, v>
        assert torch.allclose((u * got_push).sum(), (got_pull * v).sum(), rtol=1e-12, atol=0)


def test_an_unknown_piece_falls_back_to_autograd_once_and_stays_exact(prompt_ids: list[int]) -> None:
    model = tiny_model("llama", seed=4)
    ref = swept(StreamedEngine(model, sweeps="autograd"), prompt_ids, ["output", "mlp.1"], row_block=16)
    sm = StreamedEngine(model, sweeps="explicit")
    sm.steps.family = dataclasses.replace(sm.family, attentions=())  # as if the attention class were unknown
    with pytest.warns(RuntimeWarning, match="LlamaAttention is not a known piece") as record:
        got = swept(sm, prompt_ids, ["output", "mlp.1"], row_block=16)
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1  # said once
    assert _worst(ref, got) <= EXACT
    assert sm.stats.explicit_layers == 0


def test_the_ordinary_jacobian_goes_through_autograd_silently(prompt_ids: list[int]) -> None:
    model = tiny_model("mistral", seed=2)
    ref = swept(StreamedEngine(model, detach=False, sweeps="autograd"), prompt_ids, ["layer.1"], mode="forward")
    sm = StreamedEngine(model, detach=False, sweeps="explicit")
    with _no_fallback():
        got = swept(sm, prompt_ids, ["layer.1"], mode="forward")
    assert sm.stats.explicit_layers == 0 and _worst(ref, got) == 0.0


def test_pieces_that_do_not_rebuild_the_layer_are_refused(prompt_ids: list[int]) -> None:
    model = tiny_model("gemma3_text", seed=1)
    sm = StreamedEngine(model)
    trace = sm.trace(prompt_ids)
    with linearized(sm.model), sm.skeleton.layer(1):
        h = trace.inputs[1]
        step = sm.steps.step(1, trace.calls)
        record, out, mid = record_layer(sm.layers[1], sm.family, step, h)
        pieces = record.pieces()
        assert check_layer(pieces, h, out, mid) is None
        pieces.mlp.down = pieces.mlp.down * 1.01  # a post-norm gain folded twice would look like this
        with pytest.raises(NotAPiece, match="output with relative error"):
            check_layer(pieces, h, out, mid)
        pieces.attention.probs = pieces.attention.probs.transpose(1, 2)  # P where P^T belongs
        with pytest.raises(NotAPiece, match="mid residual"):
            check_layer(pieces, h, out, mid)
        wrong = dataclasses.replace(sm.family, mid_residual="no_such_child")
        with pytest.raises(NotAPiece, match="was not called"):
            record_layer(sm.layers[1], wrong, step, h)
    sm.skeleton.feed.drain()  # the layer was driven directly: end the read started ahead


def test_sweeps_are_chosen_by_option_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama", seed=0)
    assert isinstance(StreamedEngine(model).adjoint, ExplicitAdjoint)  # the default
    monkeypatch.setenv(SWEEPS_ENV, "autograd")
    assert type(StreamedEngine(model).adjoint).__name__ == "AutogradAdjoint"
    assert isinstance(StreamedEngine(model, sweeps="explicit").adjoint, ExplicitAdjoint)  # the option wins
    monkeypatch.setenv(SWEEPS_ENV, "fast")
    with pytest.raises(InvalidArgumentError, match=f"Expected {SWEEPS_ENV} one of explicit, autograd. Got 'fast'"):
        StreamedEngine(model)
    with pytest.raises(InvalidArgumentError, match="Expected sweeps one of explicit, autograd. Got 'vmap'"):
        StreamedEngine(model, sweeps="vmap")
