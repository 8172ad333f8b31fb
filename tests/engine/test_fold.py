"""Folded MLPs (engine/pieces/fold.py): one d × d matrix per position where a block carries enough rows.

Forced on and off on tiny random models of several families (gated, ungated and affine like GPT-2, mixtures of
experts), both engines, both directions, against each other and against ``torch.autograd.functional.jacobian`` of the
detached model; the pricing that chooses it (per layer shapes, per block rows) on real shapes."""

from __future__ import annotations

import pytest
import torch
from tiny_models import swept

from detjac.engine import assemble
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.engine.cost import CostModel
from detjac.engine.detach.model import linearized
from detjac.engine.inmemory.inmemory_engine import InMemoryEngine
from detjac.engine.pieces import fold
from detjac.engine.streamed.streamed_engine import StreamedEngine
from detjac.errors import InvalidArgumentError
from detjac.targets import DEFAULT_ROW_BLOCK, OUTPUTS

EXACT = 1e-12
FAMILIES = ["llama", "gemma3_text", "phi3", "gpt2", "bert", "qwen3_moe", "mixtral"]  # gated, ungated/affine, MoE


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |difference| relative to the largest entry of ``want``."""
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many MLP crossings went through the folded path (one entry per crossing: its positions)."""
    calls: list[int] = []
    real = fold.plus_folded

    def spy(acc, rows, rhs):  # type: ignore[no-untyped-def]
        calls.append(rows.x.shape[1])
        return real(acc, rows, rhs)

    monkeypatch.setattr("detjac.engine.pieces.layer.plus_folded", spy)
    return calls


def _reference(model: torch.nn.Module, ids: list[int], position: int) -> torch.Tensor:
    """``torch.autograd.functional.jacobian`` of the detached model's output at ``position`` (the reference)."""
    with linearized(model) as lin:
        x = lin.decoder.get_input_embeddings()(torch.tensor([ids]))[0].detach()
        return torch.autograd.functional.jacobian(
            lambda e: lin.decoder(inputs_embeds=e[None], use_cache=False).last_hidden_state[0, position], x)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_fold_forced_on_and_off_gives_the_reference_jacobian_in_memory(model_type: str, prompt_ids: list[int],
                                                                          counted: list[int]) -> None:
    model = tiny_model(model_type, seed=7).double()
    engine = InMemoryEngine(model)
    position = 2 if engine.family.encoder else len(prompt_ids) - 1
    got = {}
    for mode in ("never", "always"):
        with fold.folding(mode):
            trace = engine.trace(prompt_ids, position=position)  # its checks push one vector through each layer
            counted.clear()
            got[mode] = assemble(engine, trace, [OUTPUTS], engine.plan(trace, [OUTPUTS]))[OUTPUTS]
        assert trace.frozen is not None  # the explicit sweeps
        folded = len(counted)
        if mode == "never":
            assert folded == 0
    dense = sum(type(trace.frozen.pieces(i).mlp).__name__ == "Mlp" for i in range(engine.n_layers))
    assert folded == dense  # every dense MLP folded once (one block), a mixture of experts never
    if model_type == "mixtral":
        assert dense == 0 and torch.equal(got["never"], got["always"])
    else:
        assert dense > 0 and not torch.equal(got["never"], got["always"])  # another summation order: it did run
    ref = _reference(model, prompt_ids, position)
    for mode in got:
        assert _close(got[mode], ref) <= EXACT, mode
    assert _close(got["always"], got["never"]) <= EXACT


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "olmo2"])
def test_the_fold_in_the_streamed_engine_both_directions(model_type: str, prompt_ids: list[int],
                                                        counted: list[int]) -> None:
    model = tiny_model(model_type, seed=7).double()
    engine = StreamedEngine(model)
    targets = ["output", "layer.1", "mlp.0", "layer_local.0"]
    got = {}
    for mode, direction in (("never", "reverse"), ("always", "reverse"), ("always", "forward")):
        counted.clear()
        with fold.folding(mode):
            got[mode, direction] = swept(engine, prompt_ids, targets, mode=direction)
        assert (len(counted) > 0) == (mode == "always")
    ref = _reference(model, prompt_ids, len(prompt_ids) - 1)
    for key, res in got.items():
        assert _close(res["output"], ref) <= EXACT, key
        for t in targets:
            assert _close(res[t], got["never", "reverse"][t]) <= EXACT, (key, t)


def test_the_pricing_folds_only_blocks_of_enough_rows() -> None:
    d, f = 576, 1536  # SmolLM2
    assert fold.mlp_flops(d, f, d, True) < 0.7 * fold.mlp_flops(d, f, d, False)  # 31 % fewer at d rows
    threshold = d * f / (2 * f - d)  # fold pays above it
    assert not fold.fold_pays(d, f, int(threshold)) and fold.fold_pays(d, f, int(threshold) + 1)
    assert not fold.fold_pays(d, f, DEFAULT_ROW_BLOCK)
    assert not fold.fold_pays(64, 32, 10**6)  # an MLP narrower than d / 2 never pays
    with fold.folding("always"):
        assert fold.fold_pays(d, f, 1)
    with fold.folding("never"):
        assert not fold.fold_pays(d, f, d)
    assert fold.fold_pays(d, f, d)  # the policy is back to auto
    with pytest.raises(InvalidArgumentError, match="Expected a fold mode among auto, always, never. Got 'sometimes'"):
        with fold.folding("sometimes"):
            pass


def test_the_cost_model_chooses_one_whole_block_only_for_short_prompts(monkeypatch) -> None:
    from detjac.engine import cost as cost_module

    monkeypatch.setattr(cost_module, "available_memory", lambda: None)  # a machine whose free memory is unknown
    cost = CostModel(576, 1536, 30, 8, 28 * 2**20, heads=9, q=576, kv=192)
    assert cost.folds(576) and not cost.folds(64)
    assert cost.whole_block(8) and cost.whole_block(32) and not cost.whole_block(128)  # 512 MiB a block
    # a block that folds counts the fold's scratch (a few positions' d x f and d x d matrices) instead of the chunk
    held, unfolded = cost.layer_bytes_held(8, 576), cost.layer_bytes_held(8, 64)
    assert held - unfolded >= fold.fold_bytes(576, 1536, 576, 8, 8) - 8 * 64 * 8 * 1536 > 0
    assert not CostModel(576, 1536, 30, 8, 0, sweeps="autograd").folds(576)
    assert not CostModel(576, 1536, 30, 8, 0, detach=False).folds(576)


def test_the_in_memory_plan_takes_every_row_at_once_where_they_fit(prompt_ids: list[int]) -> None:
    """A short prompt's d rows fit in one block (the cost model's rule, tests/engine/test_cost.py): one sweep, which
    folds the MLPs where that pays, whichever sweeps run."""
    model = tiny_model("llama", seed=7).double()
    engine = InMemoryEngine(model)
    trace = engine.trace(prompt_ids)
    assert engine.plan(trace, [OUTPUTS]).row_block == engine.d_model and CostModel.of(model.config, 8, 0).folds(32)
    assert engine.plan(trace, [OUTPUTS], row_block=5).row_block == 5
    ordinary = InMemoryEngine(model, sweeps="autograd")
    assert ordinary.plan(ordinary.trace(prompt_ids), [OUTPUTS]).row_block == engine.d_model
