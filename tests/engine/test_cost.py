"""The cost model sizes row blocks for the sweeps that run: explicit matmuls or torch.func (no timing here)."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import swept

from detjac.engine.checkpoints.tiny import tiny_model
from detjac.engine.cost import CostModel
from detjac.engine.streamed.streamed_engine import StreamedEngine
from detjac.targets import OUTPUTS

# the benchmark's model (d 512, 4 layers, ffn 1376, 8 query / 4 key-value heads of 64), float32
SHAPES = dict(d_model=512, ffn=1376, n_layers=4, itemsize=4, layer_bytes=4 * 512 * (512 + 512 + 2 * 256 + 3 * 1376),
              heads=8, q=512, kv=256)


def _fits(cost: CostModel, n: int, rows: int) -> bool:
    return cost.weights_bytes + cost.block_bytes(n, rows) <= cost.budget


@pytest.mark.parametrize("sweeps", ["explicit", "autograd"])
def test_the_plan_takes_the_largest_block_that_fits_its_own_sweeps(sweeps: str) -> None:
    cost = CostModel(**SHAPES, budget=2 * 2**30, sweeps=sweeps)
    for n in (32, 256, 1024):
        rows = cost.plan(n, [OUTPUTS], mode="reverse").row_block
        if rows < cost.d_model:  # a budget that holds all rows takes them (evened blocks are never larger)
            assert _fits(cost, n, rows) and not _fits(cost, n, 2 * rows), (n, rows)


def test_explicit_sweeps_hold_p_once_per_layer_autograd_once_per_vector() -> None:
    explicit, autograd = (CostModel(**SHAPES, sweeps=s) for s in ("explicit", "autograd"))
    n, d, q, kv, f = 1024, 512, 512, 256, 1376
    assert explicit.vector_bytes(n) == 4 * n * (4 * d + q + kv)  # no n² term: P is not expanded over the block
    assert autograd.vector_bytes(n) == 4 * (n * (4 * d + 2 * f) + 8 * n * n)  # P once per vector
    p_bytes = 4 * 8 * n * n
    assert explicit.layer_bytes_held(n) - autograd.layer_bytes_held(n) >= p_bytes  # the weights: weights_bytes
    # a 2 GiB budget at 1,024 tokens: the explicit sweeps get several times the autograd sweeps' rows
    budget = dict(budget=2 * 2**30)
    e_rows = dataclasses.replace(explicit, **budget).plan(n, [OUTPUTS], mode="reverse").row_block
    a_rows = dataclasses.replace(autograd, **budget).plan(n, [OUTPUTS], mode="reverse").row_block
    assert e_rows >= 3 * a_rows >= 3
    # the ordinary Jacobian always goes through torch.func: sized like it
    ordinary = dataclasses.replace(explicit, detach=False, **budget)
    assert ordinary.plan(n, [OUTPUTS], mode="reverse").row_block == a_rows


def test_the_engine_sizes_for_the_sweeps_it_runs(prompt_ids: list[int]) -> None:
    model = tiny_model("qwen3", seed=3)
    explicit = StreamedEngine(model, sweeps="explicit")
    autograd = StreamedEngine(model, sweeps="autograd")
    assert explicit.cost.sweeps == "explicit" and autograd.cost.sweeps == "autograd"
    cfg = model.config
    assert explicit.cost.heads == cfg.num_attention_heads != cfg.num_key_value_heads
    assert (explicit.cost.q, explicit.cost.kv) == (cfg.num_attention_heads * 8, cfg.num_key_value_heads * 8)  # head 8
    assert explicit.cost.vector_bytes(64) < autograd.cost.vector_bytes(64)
    assert StreamedEngine(model, sweeps="explicit", detach=False).cost.sweeps == "explicit"
    assert not StreamedEngine(model, sweeps="explicit", detach=False).cost.explicit
    # once a layer falls back to torch.func, blocks are sized for it
    explicit.steps.family = dataclasses.replace(explicit.family, attentions=())
    with pytest.warns(RuntimeWarning, match="not a known piece"):
        swept(explicit, prompt_ids, ["output"], row_block=8)
    assert explicit.cost.sweeps == "autograd"


SMOLLM2 = dict(d_model=576, ffn=1536, n_layers=30, itemsize=8, layer_bytes=0, heads=9, q=576, kv=192)


def test_without_a_budget_the_block_takes_a_share_of_the_memory_this_machine_has_free(monkeypatch) -> None:
    """No --row-block and no budget, the cost model sizes the block from the machine: all d rows
    (they fold) where a quarter of the free memory holds them, else as many as fit, never below 512 MiB's worth."""
    from detjac.engine import cost as cost_module

    cost, n = CostModel(**SMOLLM2), 128  # SmolLM2's shape in float64: one vector 3 MiB at 128 tokens
    free = {"bytes": 64 * 2**30}
    monkeypatch.setattr(cost_module, "available_memory", lambda: free["bytes"])
    assert cost.plan(n, [OUTPUTS], mode="reverse").row_block == 576 and cost.whole_block(n)
    free["bytes"] = 4 * 2**30  # a quarter is 1 GiB: 341 vectors, evened into two blocks of 288
    assert cost.plan(n, [OUTPUTS], mode="reverse").row_block == 288 and not cost.whole_block(n)
    for small in (2**30, None):  # little free memory, or none known: 512 MiB's worth, 170 vectors, evened to 144
        free["bytes"] = small
        assert cost.plan(n, [OUTPUTS], mode="reverse").row_block == 144
    assert cost.plan(n, [OUTPUTS], mode="reverse", row_block=7).row_block == 7  # an override is taken as it is


def test_a_worker_sizes_its_unbudgeted_block_from_its_own_memory_limit(monkeypatch) -> None:
    """N workers on one machine each see the machine's free memory; each sizes its block from its own
    limit (dask's per-worker memory limit, set by the run's model plugin) less what it holds."""
    from types import SimpleNamespace

    from detjac import machine
    from detjac.engine import cost as cost_module
    from detjac.runs.cluster import ModelPlugin

    cost, n = CostModel(**SMOLLM2), 128
    monkeypatch.setattr(machine, "_machine_available", lambda: 64 * 2**30)
    monkeypatch.setattr(machine, "resident_bytes", lambda: 2**30)
    monkeypatch.setattr(cost_module, "available_memory", machine.available_memory)
    assert machine.available_memory() == 64 * 2**30 and cost.plan(n, [OUTPUTS], mode="reverse").row_block == 576
    plugin = ModelPlugin(spec=None, name="p")  # type: ignore[arg-type]
    try:
        plugin.setup(SimpleNamespace(memory_manager=SimpleNamespace(memory_limit=5 * 2**30)))
        assert machine.available_memory() == 4 * 2**30  # its 5 GiB less the 1 GiB it holds
        assert cost.plan(n, [OUTPUTS], mode="reverse").row_block == 288  # a quarter of 4 GiB, as on a 4 GiB machine
        machine.set_memory_cap(2**29)  # holding more than its limit: nothing left, the 512 MiB floor
        assert machine.available_memory() == 0 and cost.plan(n, [OUTPUTS], mode="reverse").row_block == 144
    finally:
        machine.set_memory_cap(None)
    assert machine.available_memory() == 64 * 2**30


def test_the_in_memory_engine_plans_its_block_with_the_cost_model(monkeypatch, prompt_ids: list[int]) -> None:
    """The in-memory engine has no rule of its own: without a row block its plan is its cost model's (for the sweeps
    its trace runs), the detached and the ordinary Jacobian alike."""
    from detjac.engine import InMemoryEngine
    from detjac.engine import cost as cost_module

    model = tiny_model("llama", seed=7, hidden_size=96, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=24).double()
    for engine in (InMemoryEngine(model), InMemoryEngine(model, detach=False)):
        trace = engine.trace(prompt_ids)
        explicit = trace.frozen is not None
        assert explicit == engine.detach  # the ordinary Jacobian goes through torch.func
        cost = CostModel.of(model.config, 8, 0, detach=engine.detach, sweeps="explicit" if explicit else "autograd")
        monkeypatch.setattr(cost_module, "available_memory", lambda: 0)  # 512 MiB: every row fits
        assert engine.plan(trace, [OUTPUTS]).row_block == 96 == cost.plan(len(prompt_ids), [OUTPUTS]).row_block
        # a machine whose block may hold only 40 vectors: the cost model's 64-row floor, evened out over d = 96
        monkeypatch.setattr(cost_module, "UNBUDGETED_BLOCK_BYTES", 40 * cost.vector_bytes(len(prompt_ids)))
        assert engine.plan(trace, [OUTPUTS]).row_block == 48 == cost.plan(len(prompt_ids), [OUTPUTS]).row_block
        assert engine.plan(trace, [OUTPUTS], row_block=5).row_block == 5
        monkeypatch.undo()
