"""Every engine through the same checks: the interface callers rely on, so none of them asks which it holds."""

from __future__ import annotations

import pytest
import torch

from detjac.engine import (
    Engine,
    InMemoryEngine,
    StreamedEngine,
    as_engine,
    jacobian,
    jacobian_operator,
    load_engine,
    load_model,
)
from detjac.engine.detach.wrappers import DetachedNorm
from detjac.errors import InvalidArgumentError, PromptError
from detjac.exactness import relative_error
from detjac.targets import OUTPUTS, Target


@pytest.fixture(params=["in-memory", "streamed"])
def engine(request, llama_checkpoint) -> Engine:
    return load_engine(llama_checkpoint, streamed=request.param == "streamed")


@pytest.fixture(scope="module")
def reference(llama_checkpoint):
    """The output's Jacobian (d, n, d) of the in-memory model, formed directly."""

    return jacobian(InMemoryEngine(load_model(llama_checkpoint)), list(range(3, 20)))


def test_load_engine_picks_by_the_options(llama_checkpoint):
    assert isinstance(load_engine(llama_checkpoint), InMemoryEngine)
    assert isinstance(load_engine(llama_checkpoint, streamed=True), StreamedEngine)
    assert isinstance(load_engine(llama_checkpoint, max_memory="cpu=8GiB"), StreamedEngine)
    model = load_model(llama_checkpoint)
    assert isinstance(as_engine(model), InMemoryEngine)
    streamed = StreamedEngine(model)
    assert as_engine(streamed) is streamed


def test_trace_blocks_and_products_agree_across_engines(engine, reference):
    ids = reference.token_ids
    trace = engine.trace(ids)
    assert trace.token_ids == ids and trace.position == len(ids) - 1
    assert torch.allclose(trace.output, reference.output, rtol=0, atol=1e-12)
    assert torch.equal(trace.source(OUTPUTS), trace.embeddings) and torch.equal(trace.value(OUTPUTS), trace.output)
    plan = engine.plan(trace, [OUTPUTS], row_block=5)
    assert plan.reverse == [OUTPUTS] and plan.row_block == 5 and plan.n_row_blocks == -(-engine.d_model // 5)
    J = torch.zeros_like(reference.jacobian)
    for b in engine.blocks(trace, [OUTPUTS], plan):
        assert b.target == OUTPUTS and b.stop - b.start <= 5
        J[b.start:b.stop, b.token_start:b.token_stop] = b.values
    assert relative_error(J, reference.jacobian) < 1e-12
    V = torch.randn(3, len(ids), engine.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    U = torch.randn(3, engine.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    Jc = reference.combined()
    assert relative_error(engine.push(trace, V), (Jc @ V.reshape(3, -1).T).T) < 1e-12
    assert relative_error(engine.pull(trace, U).reshape(3, -1), U @ Jc) < 1e-12


def test_decoding_logits_and_tokens_agree_across_engines(engine, reference, llama_checkpoint):
    model = load_model(llama_checkpoint)
    mats = engine.decoding_matrices()
    assert set(mats) == {"embedding", "unembedding", "final_norm"}
    assert torch.equal(mats["embedding"], model.get_input_embeddings().weight.detach())
    assert torch.equal(mats["unembedding"], model.get_output_embeddings().weight.detach())
    assert mats["unembedding"].device.type == "cpu" and engine.decoding_matrices(torch.float32)["embedding"].dtype \
        == torch.float32
    logits = engine.logits(reference.output)
    assert relative_error(logits, reference.logits) < 1e-12
    assert engine.token_ids(reference.token_ids) == reference.token_ids
    with pytest.raises(PromptError, match="at least one token"):
        engine.trace("")
    with pytest.raises(InvalidArgumentError, match="position"):
        engine.trace(reference.token_ids, position=100)


def test_operator_block_comes_from_the_engine_plan(engine, reference):
    op = jacobian_operator(engine, reference.token_ids)
    assert op.block == engine.plan(op.trace, [OUTPUTS], mode="reverse").row_block
    assert op.check() < 1e-12


def test_in_memory_engine_refuses_layerwise_targets_by_name(llama_checkpoint):
    engine = load_engine(llama_checkpoint)
    trace = engine.trace([5, 6, 7])
    with pytest.raises(InvalidArgumentError, match="layer.1.*layer-streamed engine"):
        engine.plan(trace, [OUTPUTS, Target.parse("layer.1")])
    with pytest.raises(InvalidArgumentError, match="Expected mode auto or reverse"):
        engine.plan(trace, [OUTPUTS], mode="forward")


def test_a_trace_of_one_engine_is_refused_by_the_other(llama_checkpoint):
    a, b = load_engine(llama_checkpoint), load_engine(llama_checkpoint, streamed=True)
    with pytest.raises(InvalidArgumentError, match="Expected a trace from the layer-streamed engine"):
        list(b.blocks(a.trace([5, 6, 7]), [OUTPUTS]))
    with pytest.raises(InvalidArgumentError, match="Expected a trace from the in-memory engine"):
        a.pull(b.trace([5, 6, 7]), torch.zeros(1, a.d_model, dtype=torch.float64))


def test_streamed_skeleton_is_linearized_only_while_it_computes(llama_checkpoint):
    sm = StreamedEngine(llama_checkpoint)

    def detached_norms() -> int:
        return sum(isinstance(m, DetachedNorm) for m in sm.model.modules())

    assert detached_norms() == 0  # constructed (and guarded), nothing left entered
    blocks = sm.blocks(sm.trace([5, 6, 7, 8]), [OUTPUTS, Target.parse("mlp.0", sm.n_layers)])
    next(blocks)
    assert detached_norms() > 0  # inside the sweep
    blocks.close()
    assert detached_norms() == 0
    assert sm.record(sm.plan(sm.trace([5, 6]), [OUTPUTS]))["stream"]["bytes_read"] == sm.stats.bytes_read


@pytest.mark.parametrize(("device", "max_memory"), [("cpu", None), ("cpu", "cpu=8GiB"), ("cpu", "CPU=8GiB"),
                                                     ("cpu:0", "cpu=8GiB"), ("cpu", "cuda:0=8GiB"),
                                                     ("cuda:0", "cpu=8GiB")])
def test_the_cli_sets_the_allocator_exactly_when_the_engine_it_loads_computes_under_a_cpu_budget(
        monkeypatch, llama_checkpoint, device, max_memory):
    """The command line's options and the engine they load agree on when this process's allocator hands freed memory
    back: the engine computes on the CPU and holds a CPU budget, whatever the spelling of either."""
    import click
    from click.testing import CliRunner

    from detjac.cli.options import model_options
    from detjac.engine import memory

    calls: list[int] = []
    monkeypatch.setattr(memory, "return_freed_memory", lambda: calls.append(1))

    @click.command()
    @model_options()
    def probe(model_options) -> None:
        pass

    args = ["--device", device, *(["--max-memory", max_memory] if max_memory else [])]
    assert CliRunner().invoke(probe, args, catch_exceptions=False).exit_code == 0
    if "cuda" in device + (max_memory or ""):  # not loadable here; on a GPU, or without a CPU budget: no setting
        under_budget = False
    else:
        engine = load_engine(llama_checkpoint, device=device, max_memory=max_memory)
        under_budget = engine.device.type == "cpu" and engine.memory_budget("cpu") is not None
    assert calls == ([1] if under_budget else [])


def test_an_engine_answers_six_things_and_every_walk_is_swept_by_the_same_functions():
    from detjac.engine.checkpoints.tiny import tiny_model

    assert sorted(Engine.__abstractmethods__) == ["cost_model", "decoding_matrices", "logits", "stock_logits",
                                                  "trace", "walk"]
    model, ids = tiny_model("llama", seed=7), [5, 6, 7, 8, 9]
    got = {}
    for sweeps in ("explicit", "autograd"):
        engine = InMemoryEngine(model, sweeps=sweeps)
        trace = engine.trace(ids)
        with engine.walk(trace) as walk:
            got[sweeps] = (type(walk).__name__, walk.n_layers)
            if sweeps == "autograd":  # the whole model at once: no layer to enter, refused by name
                with pytest.raises(InvalidArgumentError, match="explicit pieces for layer 0. Got one whose sweeps "
                                                               "went through torch.func: chosen"):
                    walk.layer(0)
        got[sweeps + " rows"] = torch.cat([b.values for b in engine.blocks(trace, [OUTPUTS])])
    assert got["explicit"] == ("FrozenModel", 3) and got["autograd"] == ("AutogradWalk", 0)
    want = got["explicit rows"]
    assert (got["autograd rows"] - want).abs().max() <= 1e-12 * want.abs().max()
