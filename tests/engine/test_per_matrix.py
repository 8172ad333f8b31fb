"""A layer widened a matrix at a time (each linear weight widened just before its use, then dropped) computes the same
Jacobian as a layer widened whole and as the in-memory engine, and the planner counts it.

Tiny bfloat16 checkpoints (Llama; Phi3's fused projections; Gemma 3's norms after the cores, folded into ``W_o`` and
``W_down``) and a tiny Q4_0 GGUF stream in float64 under a budget too small for a layer widened whole: the cost
model picks a matrix at a time, the reconstruction is below 1e-12 and the J equals the whole-layer and in-memory
ones within float64 rounding. The planner works from the config's shapes alone: the Llama-3.3-70B shape from
bfloat16 weights at ``cuda:0=8GiB``, 16 tokens, in float32 and float64, and the 8B shape at 4 GiB."""

from __future__ import annotations

import pytest
import torch

from benchmarks.support.random_weights import write_random_gguf
from benchmarks.support.real_shapes import REAL_SHAPES
from detjac.engine import InMemoryEngine, StreamedEngine, jacobian, load_model, prompt_pass
from detjac.engine.checkpoints.tiny import save_tiny_checkpoint, tiny_config
from detjac.engine.cost import CostModel
from detjac.engine.pieces.lazy import ATTR, LazyWeight
from detjac.errors import InvalidArgumentError
from detjac.targets import Target

IDS = [5, 17, 42, 9, 77, 120, 3, 64, 150, 11, 98, 31, 7]
EXACT = 1e-12
FAMILIES = ("llama", "phi3", "gemma3")
GGUF = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=320, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, object] = {}

    def get(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            if name == "gguf":
                write_random_gguf(folder / "tiny-Q4_0.gguf", GGUF, "Q4_0")
                made[name] = folder / "tiny-Q4_0.gguf"
            else:
                made[name] = save_tiny_checkpoint(folder / name, name, seed=3, dtype=torch.bfloat16)
        return made[name]

    return get


def tight(location) -> tuple[StreamedEngine, StreamedEngine]:
    """The engine without a budget (a layer widened whole), and under a budget one byte short of a layer widened
    whole with the trace and a layer's crossing: a matrix at a time."""
    whole = StreamedEngine(location, dtype=torch.float64)
    cost, n = whole.cost, len(IDS)
    budget = cost.weights_bytes + cost.block_bytes(n, 0) - 1
    return whole, StreamedEngine(location, dtype=torch.float64, max_memory=f"cpu={budget}B")


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= EXACT * want.abs().max())


@pytest.mark.parametrize("name", FAMILIES + ("gguf",))
def test_a_budget_too_small_for_a_layer_widened_whole_widens_a_matrix_at_a_time_exactly(name, checkpoints):
    whole, sm = tight(checkpoints(name))
    n = len(IDS)
    assert not whole.cost.per_matrix(n) and sm.cost.per_matrix(n)
    assert sm.cost.held_weights_bytes(n) == 2 * sm.cost.stored_layer_bytes + sm.cost.matrix_bytes
    res = jacobian(sm, IDS)
    assert res.reconstruction_error < EXACT
    assert sm.stats.matrices_widened > 0 and sm.stats.explicit_layers > 0 and not sm.skeleton.owned
    ref = jacobian(whole, IDS)
    assert whole.stats.matrices_widened == 0
    assert same(res.jacobian, ref.jacobian)
    if name != "gguf":  # the GGUF's own reference is in test_stored_dtype.py (the gguf package's decoder)
        mem = jacobian(InMemoryEngine(load_model(checkpoints(name), dtype=torch.float64)), IDS)
        assert same(res.jacobian, mem.jacobian)


@pytest.mark.parametrize("sweeps", ["explicit", "autograd"])
def test_a_matrix_at_a_time_in_both_modes_and_both_sweeps(sweeps, checkpoints, monkeypatch):
    """Layerwise targets, reverse and forward mode, explicit and torch.func sweeps: the cost model's decision forced
    (a tiny model's d is too small for a budget that takes a matrix at a time and d vectors)."""
    folder = checkpoints("gemma3")
    targets = [Target.parse(t, 3) for t in ("layer.0", "mlp_normed.1", "attn_local.2", "output")]
    want = prompt_pass(StreamedEngine(folder, dtype=torch.float64, sweeps=sweeps), IDS, targets, mode="reverse")
    monkeypatch.setattr(CostModel, "per_matrix", lambda self, n: True)
    sm = StreamedEngine(folder, dtype=torch.float64, sweeps=sweeps)
    for mode in ("reverse", "forward"):
        got = prompt_pass(sm, IDS, [t for t in targets if mode == "reverse" or not t.local], mode=mode,
                          token_block=4)
        assert got.plan.widen == "matrix"
        for t, j in got.jacobians.items():
            assert same(j, want.jacobians[t]), (mode, t)
    assert sm.stats.matrices_widened > 0


def test_a_layer_loaded_a_matrix_at_a_time_holds_its_linear_weights_as_stored(checkpoints):
    sm = StreamedEngine(checkpoints("llama"), dtype=torch.float64)
    sm.skeleton.per_matrix = True
    sm.skeleton.load_layer(0)
    up = sm.layers[0].mlp.up_proj
    try:
        lazy = getattr(up, ATTR)
        assert isinstance(lazy, LazyWeight) and lazy.stored.dtype == torch.bfloat16 and up.weight.is_meta
        assert sm.layers[0].input_layernorm.weight.dtype == torch.float64  # the vectors widened with the layer
        seen = []
        up.register_forward_hook(lambda m, a, o: seen.append(m.weight.dtype))
        up(torch.zeros(2, sm.d_model, dtype=torch.float64))
        assert seen == [torch.float64] and up.weight.is_meta  # widened for the call, dropped after it
        assert torch.equal(lazy.widened(), lazy.stored.double())
    finally:
        sm.skeleton.release_layer(0)
    assert not hasattr(up, ATTR) and up.weight.is_meta


def plan_of(shape: str, itemsize: int, gib: int, tokens: int = 16):
    """The planner on a real shape from bfloat16 weights on a CUDA device (no weights: the config's shapes)."""
    cfg = {k: v for k, v in REAL_SHAPES[shape].items() if k != "model_type"}
    config = tiny_config("llama", **cfg)
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    params = 2 * d * q + 2 * d * kv + 3 * d * f + 2 * d
    cost = CostModel.of(config, itemsize, params * itemsize, budget=gib * 2**30, device="cuda:0",
                        stored_bytes=2 * params)
    return cost, cost.plan(tokens, [Target(-1, "output")], mode="reverse")


def test_the_planner_accepts_the_70b_shape_in_float32_and_float64_at_8_gib_and_the_8b_shape_at_4_gib():
    cost, plan = plan_of("llama-3.3-70b", 4, 8)
    assert (plan.n_row_blocks, plan.row_block, plan.widen) == (8, 1024, "matrix")
    cost, plan = plan_of("llama-3.3-70b", 8, 8)
    assert (plan.n_row_blocks, plan.row_block, plan.widen) == (47, 175, "matrix")
    # two layers as stored (1.59 GiB each) and the MLP's two projections in float64 (3.5 GiB), not the layer (6.38)
    assert cost.held_weights_bytes(16) == 2 * cost.stored_bytes + cost.matrix_bytes < 8 * 2**30 < cost.weights_bytes
    assert cost.matrix_bytes == 8 * (2 * 8192 * 28672 + 8 * 8192)
    for itemsize, blocks in ((4, (3, 1366)), (8, (9, 456))):  # the 8B shape fits 4 GiB widened whole
        _, plan = plan_of("llama-3.1-8b", itemsize, 4)
        assert (plan.n_row_blocks, plan.row_block, plan.widen) == (*blocks, "layer")


def test_a_budget_too_small_even_a_matrix_at_a_time_says_what_it_must_hold():
    with pytest.raises(InvalidArgumentError, match=r"^Expected a memory budget that holds two layers as stored "
                       r"\(1\.59 GiB each: the one in use and the next, read ahead\), the one in use widened a matrix "
                       r"at a time \(3\.50 GiB at once, of 6\.38 GiB in the compute dtype\), the trace and .* at 16 "
                       r"tokens .* and at least 1 vector of .*: .* in all\. Got 4\.00 GiB for cuda:0: raise "
                       r"--max-memory\.$"):
        plan_of("llama-3.3-70b", 8, 4)


def test_whole_or_a_matrix_at_a_time_is_decided_in_one_place():
    """The skeleton's mode is set only by the engine, from CostModel.per_matrix (through the plan's ``widen``)."""
    from pathlib import Path

    import detjac.engine as engine

    root = Path(engine.__file__).parent
    setters = {p.relative_to(root).as_posix(): [line.strip() for line in p.read_text().splitlines()
                                                  if ".per_matrix = " in line] for p in root.rglob("*.py")}
    setters = {k: v for k, v in setters.items() if v}
    assert set(setters) == {"streamed/streamed_engine.py", "streamed/skeleton.py"}
    assert all("cost.per_matrix(" in line or "plan.widen" in line for line in setters["streamed/streamed_engine.py"])
    assert setters["streamed/skeleton.py"] == ["self.per_matrix = False"]
