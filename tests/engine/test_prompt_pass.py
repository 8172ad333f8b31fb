"""One prompt pass: every product of a prompt from one trace, whatever asks for it (``detjac run``, also with
``--graph``, ``detjac graph``, ``jacobian()``, ``attribution_graph()``); the old Jacobian entry points still answer,
each with a ``DeprecationWarning``."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from detjac.engine import (
    GraphRequest,
    InMemoryEngine,
    StreamedEngine,
    jacobian,
    prompt_pass,
)
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.targets import OUTPUTS

PROMPTS = ["The fog", "A cat"]  # short: every test here costs seconds


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama", seed=3).double()


@pytest.fixture
def traces(monkeypatch) -> list[list[int]]:
    """The token ids of every trace the in-memory engine runs, in order."""
    seen: list[list[int]] = []
    original = InMemoryEngine.trace

    def counted(self, prompt, **kwargs):
        trace = original(self, prompt, **kwargs)
        seen.append(list(trace.token_ids))
        return trace

    monkeypatch.setattr(InMemoryEngine, "trace", counted)
    return seen


def _cli(*args: str) -> str:
    from detjac.cli.main import main

    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("graph", [False, True], ids=["run", "run --graph"])
def test_run_traces_each_prompt_once(llama_checkpoint, tmp_path, traces, graph):
    from detjac.store import open_store

    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    extra = ["--graph", "--graph-max-nodes", "4"] if graph else []
    _cli("run", str(llama_checkpoint), str(prompts), "--out", str(tmp_path / "r.zarr"), *extra)
    store = open_store(tmp_path / "r.zarr")
    assert len(store) == len(PROMPTS)
    assert sorted(traces) == sorted(p.attrs["token_ids"] for p in store)  # one trace per prompt, no more
    assert all((p.graph() is not None) == graph for p in store)


def test_graph_traces_the_prompt_once(llama_checkpoint, tmp_path, traces):
    _cli("graph", str(llama_checkpoint), "-p", PROMPTS[0], "--out", str(tmp_path / "g.json"), "--max-nodes", "4")
    assert len(traces) == 1


def test_one_pass_gives_the_jacobian_its_errors_and_the_graph_from_one_trace(model, prompt_ids, traces):
    engine = InMemoryEngine(model)
    products = prompt_pass(engine, prompt_ids[:6], graph=GraphRequest(max_nodes=4))
    assert len(traces) == 1 and products.graph is not None and products.graph.n_tokens == 6
    jac = products.jacobians[OUTPUTS]
    assert products.errors[OUTPUTS] < 1e-12 and jac.shape == (32, 6, 32)
    res = jacobian(engine, prompt_ids[:6])
    assert torch.equal(res.jacobian, jac) and res.reconstruction_error == products.errors[OUTPUTS]


def test_a_pass_without_targets_only_traces(model, prompt_ids):
    products = prompt_pass(InMemoryEngine(model), prompt_ids[:4], [])
    assert products.plan is None and products.errors == {} and products.trace.n_tokens == 4


def test_the_old_entry_points_warn_and_agree(model, prompt_ids):
    from detjac.engine import detached_jacobian, stream_jacobian

    ids = prompt_ids[:5]
    want = jacobian(InMemoryEngine(model), ids).jacobian
    with pytest.warns(DeprecationWarning, match=r"detached_jacobian\(model, prompt\) is deprecated"):
        assert torch.equal(detached_jacobian(model, ids).jacobian, want)
    with pytest.warns(DeprecationWarning, match=r"Engine.jacobian\(prompt\) is deprecated"):
        assert torch.equal(InMemoryEngine(model).jacobian(ids).jacobian, want)
    with pytest.warns(DeprecationWarning, match=r"stream_jacobian\(model, prompt\) is deprecated"):
        stream = stream_jacobian(model, ids, row_block=8)
    assert (torch.cat([b.values for b in stream]) - want).abs().max() <= 1e-12 * want.abs().max()
    streamed = StreamedEngine(model)
    with pytest.warns(DeprecationWarning, match=r"StreamedEngine.jacobians\(prompt, targets\) is deprecated"):
        got = streamed.jacobians(ids, ["output"])["output"]
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()
