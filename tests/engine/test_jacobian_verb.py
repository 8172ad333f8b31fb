"""The one Jacobian verb over :class:`Engine`: the same result type and the same numbers from both engines, the
applications built on it (exactness report, decoded triplets) streaming too, ``--out run.zarr`` computing the
Jacobian once, and the renamed names still importable with one warning."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from click.testing import CliRunner

from detjac.engine import (
    InMemoryEngine,
    JacobianResult,
    KeptEngine,
    StreamedEngine,
    detached_jacobian,
    exactness_report,
    explain,
    jacobian,
)
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.targets import OUTPUTS

EXACT = 1e-12


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama", seed=7).double()


def test_both_engines_give_one_result_type_with_the_same_jacobian(model, prompt_ids):
    mem, streamed = jacobian(InMemoryEngine(model), prompt_ids), jacobian(StreamedEngine(model), prompt_ids)
    direct = detached_jacobian(model, prompt_ids)
    for res in (mem, streamed, direct):
        assert isinstance(res, JacobianResult) and res.jacobian.shape == (32, len(prompt_ids), 32)
        assert res.reconstruction_error < EXACT and res.detached and res.family == "Llama"
    assert (mem.jacobian - streamed.jacobian).abs().max() / mem.jacobian.abs().max() < EXACT
    assert torch.equal(mem.jacobian, direct.jacobian) and direct.row_block == mem.row_block == 32  # one plan
    assert detached_jacobian(model, prompt_ids, row_block=5).row_block == 5
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


def test_a_kept_engine_hands_back_what_it_computed(model, prompt_ids, monkeypatch):
    kept = KeptEngine(InMemoryEngine(model))
    res = jacobian(kept, prompt_ids, row_block=7)
    trace = kept.trace(prompt_ids, position=-1)
    monkeypatch.setattr(kept.inner, "blocks", lambda *a, **k: pytest.fail("computed again"))
    plan = kept.plan(trace, [OUTPUTS], row_block=7)
    blocks = list(kept.blocks(trace, [OUTPUTS], plan))
    assert [(b.start, b.stop) for b in blocks] == [(r, min(r + 7, 32)) for r in range(0, 32, 7)]
    assert torch.equal(torch.cat([b.values for b in blocks]), res.jacobian)
    assert kept.trace(prompt_ids[:-1]) is not trace  # another prompt: the inner engine's own trace


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


def test_renamed_names_warn_once():
    import detjac.engine as engine

    engine._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from detjac.engine import RowBlock, StreamedModel
        from detjac.engine import StreamedModel as again
    assert StreamedModel is again is StreamedEngine and RowBlock is engine.JacobianBlock
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert messages == ["detjac.engine.RowBlock is now JacobianBlock; the old name will be removed.",
                        "detjac.engine.StreamedModel is now StreamedEngine; the old name will be removed."]
    with pytest.raises(ImportError):
        from detjac.engine import NoSuchName  # noqa: F401


def test_jacobian_prints_the_same_streamed(llama_checkpoint):
    from detjac.cli.main import main

    def lines(*extra: str) -> list[str]:
        result = CliRunner().invoke(main, ["jacobian", str(llama_checkpoint), "-p", "The fog rolls over", *extra])
        assert result.exit_code == 0, result.output
        # progress lines ("detached Jacobian: blocks: 1/1 block (100%) in 0.0 s")
        bars = re.compile(r"^([\w ]+: )+\d+(/\d+)? \w+")
        return [line.split("   (")[0] for line in result.output.splitlines() if not bars.match(line)]  # time aside

    in_memory, streamed = lines(), lines("--streamed")
    assert len(in_memory) >= 8 and in_memory[:3] == streamed[:3]  # model, tokens, next token
    assert in_memory[5:] == streamed[5:]  # the decoded triplets of sum_k J_k


def test_both_engines_count_the_same_parameters():
    from detjac.engine import load_engine

    in_memory, streamed = load_engine("default"), load_engine("default", streamed=True)
    assert in_memory.parameter_count() == streamed.parameter_count() == 4_524_288  # tied unembedding counted once
