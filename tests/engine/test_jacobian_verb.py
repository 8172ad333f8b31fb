"""The one Jacobian verb over :class:`Engine`: the same result type and the same numbers from both engines, the
applications built on it (exactness report, decoded triplets) streaming too, ``--out run.zarr`` computing the
Jacobian once, and the renamed names still importable with one warning."""

from __future__ import annotations

import re
from contextlib import contextmanager

import pytest
import torch
from click.testing import CliRunner

from detjac.engine import (
    InMemoryEngine,
    JacobianResult,
    ResultSink,
    StreamedEngine,
    Tee,
    exactness_report,
    explain,
    jacobian,
    prompt_pass,
)
from detjac.engine.checkpoints.tiny import tiny_model

EXACT = 1e-12


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama", seed=7).double()


def test_both_engines_give_one_result_type_with_the_same_jacobian(model, prompt_ids):
    mem, streamed = jacobian(InMemoryEngine(model), prompt_ids), jacobian(StreamedEngine(model), prompt_ids)
    direct = jacobian(InMemoryEngine(model), prompt_ids)
    for res in (mem, streamed, direct):
        assert isinstance(res, JacobianResult) and res.jacobian.shape == (32, len(prompt_ids), 32)
        assert res.reconstruction_error < EXACT and res.detached and res.family == "Llama"
    assert (mem.jacobian - streamed.jacobian).abs().max() / mem.jacobian.abs().max() < EXACT
    assert torch.equal(mem.jacobian, direct.jacobian) and direct.row_block == mem.row_block == 32  # one plan
    assert jacobian(InMemoryEngine(model), prompt_ids, row_block=5).row_block == 5
    assert mem.detach_rules == streamed.detach_rules == direct.detach_rules != []
    assert mem.next_token_id == streamed.next_token_id
    ordinary = jacobian(StreamedEngine(model).ordinary(), prompt_ids)
    assert not ordinary.detached and ordinary.detach_rules == [] and ordinary.reconstruction_error > 1e-3


def test_the_exactness_report_and_the_triplets_stream(model, prompt_ids):
    mem, streamed = exactness_report(model, prompt_ids), exactness_report(StreamedEngine(model), prompt_ids)
    assert abs(mem.ordinary.reconstruction_error - streamed.ordinary.reconstruction_error) < 1e-9
    assert mem.argmax_agrees == streamed.argmax_agrees
    assert abs(mem.stock_logit_diff - streamed.stock_logit_diff) < 1e-9
    a, b = explain(mem.detached, model, k=2, top=3), explain(streamed.detached, StreamedEngine(model), k=2, top=3)
    assert torch.equal(a.combined.left_ids, b.combined.left_ids) and torch.equal(a.combined.right_ids,
                                                                                 b.combined.right_ids)


class _Seen:
    """A sink that records what it is handed (a store's stand-in)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.blocks: list[tuple[int, int]] = []

    @contextmanager
    def open(self, products):
        self.events.append("open")
        yield
        self.events.append("closed")

    def take(self, block) -> None:
        self.blocks.append((block.start, block.stop))

    def more(self) -> bool:
        return False

    def finish(self, products) -> None:
        self.events.append("finish")


def test_a_result_sink_teed_beside_a_store_holds_what_jacobian_returns(model, prompt_ids):
    engine = InMemoryEngine(model)
    seen, kept = _Seen(), ResultSink(engine, prompt_ids[:6])
    products = prompt_pass(engine, prompt_ids[:6], row_block=7, sink=Tee(seen, kept))
    assert seen.blocks == [(r, min(r + 7, 32)) for r in range(0, 32, 7)] and seen.events == ["open", "finish",
                                                                                            "closed"]
    want = jacobian(engine, prompt_ids[:6], row_block=7)
    assert products.jacobians == {} and kept.result is not None  # the sinks took the blocks
    assert torch.equal(kept.result.jacobian, want.jacobian) and torch.equal(kept.result.logits, want.logits)
    assert kept.result.reconstruction_error == want.reconstruction_error < EXACT


def test_jacobian_out_store_computes_the_jacobian_once(llama_checkpoint, tmp_path, monkeypatch):
    from detjac.cli.main import main
    from detjac.store import open_store

    calls = []
    original = InMemoryEngine.blocks

    def counted(self, *args, **kwargs):
        calls.append(self.detach)
        yield from original(self, *args, **kwargs)

    monkeypatch.setattr(InMemoryEngine, "blocks", counted)
    out = tmp_path / "one.zarr"
    result = CliRunner().invoke(main, ["jacobian", str(llama_checkpoint), "-p", "The fog rolls over the",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert calls == [True, False]  # the detached and the ordinary Jacobian, each once: the store took the first
    store = open_store(out)
    (pid,) = store.prompt_ids()
    assert store.get(pid).attrs["reconstruction_error"] < EXACT
    again = CliRunner().invoke(main, ["jacobian", str(llama_checkpoint), "-p", "The fog rolls over the",
                                      "--no-ordinary", "--out", str(out)])
    assert again.exit_code == 0, again.output  # stored already: the run computes nothing, the report its own
    assert calls == [True, False, True] and f"stored as prompt {pid} in {out}" in again.output
    detached = [re.search(r"reconstruction error  detached (\S+)", r.output).group(1) for r in (result, again)]
    assert detached[0] == detached[1]  # the stored pass's and the report's own


def test_the_facade_holds_what_users_and_the_layers_above_need():
    from types import ModuleType

    import detjac.engine as engine

    public = {n for n in dir(engine) if not n.startswith("_") and not isinstance(getattr(engine, n), ModuleType)}
    assert public == set(engine.__all__) and len(public) <= 60
    for gone in ("RowBlock", "StreamedModel", "detached_jacobian", "stream_jacobian", "KeptEngine", "JacobianStream",
                 "StreamedResult"):
        assert not hasattr(engine, gone), gone
    with pytest.raises(ImportError):
        from detjac.engine import NoSuchName  # noqa: F401

def test_jacobian_prints_the_same_streamed(llama_checkpoint):
    from detjac.cli.main import main

    def lines(*extra: str) -> list[str]:
        result = CliRunner().invoke(main, ["jacobian", str(llama_checkpoint), "-p", "The fog rolls over", *extra])
        assert result.exit_code == 0, result.output
        # progress lines ("detached Jacobian: blocks: 1/1 block (100%) in 0.0 s")
        bars = re.compile(r"^([\w ]+: )+\d+(/\d+)? \w+")
        return [line.split("   (")[0] for line in result.stdout.splitlines() if not bars.match(line)]  # time aside

    in_memory, streamed = lines(), lines("--streamed")
    assert len(in_memory) >= 8 and in_memory[:3] == streamed[:3]  # model, tokens, next token
    assert in_memory[5:] == streamed[5:]  # the decoded triplets of sum_k J_k


def test_both_engines_count_the_same_parameters():
    from detjac.engine import load_engine

    in_memory, streamed = load_engine("default"), load_engine("default", streamed=True)
    assert in_memory.parameter_count() == streamed.parameter_count() == 4_524_288  # tied unembedding counted once
