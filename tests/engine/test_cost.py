"""The cost model sizes row blocks for the sweeps that run: explicit matmuls or torch.func (no timing here)."""

from __future__ import annotations

import dataclasses

import pytest

from detjac.engine.checkpoints.tiny import tiny_model
from detjac.engine.streamed.cost import CostModel
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
        explicit.jacobians(prompt_ids, ["output"], row_block=8)
    assert explicit.cost.sweeps == "autograd"
