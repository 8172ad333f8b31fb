"""One prompt pass: every product of a prompt from one trace, whatever asks for it (``detjac run``, also with
``--graph``, ``detjac graph``, ``jacobian()``, ``attribution_graph()``)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from detjac.engine import InMemoryEngine, StreamedEngine, jacobian, prompt_pass
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.graph_settings import GraphSettings
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
    from detjac.graphs import graph_step

    engine = InMemoryEngine(model)
    products = prompt_pass(engine, prompt_ids[:6], graph=graph_step(engine, GraphSettings(max_nodes=4)))
    assert len(traces) == 1 and products.graph is not None and products.graph.n_tokens == 6
    jac = products.jacobians[OUTPUTS]
    assert products.errors[OUTPUTS] < 1e-12 and jac.shape == (32, 6, 32)
    res = jacobian(engine, prompt_ids[:6])
    assert torch.equal(res.jacobian, jac) and res.reconstruction_error == products.errors[OUTPUTS]


def test_a_pass_without_targets_only_traces(model, prompt_ids):
    products = prompt_pass(InMemoryEngine(model), prompt_ids[:4], [])
    assert products.plan is None and products.errors == {} and products.trace.n_tokens == 4


def test_a_taken_block_is_let_go_before_the_next_is_computed(model, monkeypatch) -> None:
    """A budget counts one block's rows at a time: each block's values are freed once taken, before the streamed
    engine takes the next block into any layer (held until then, they were a block's rows the budget never saw)."""
    import weakref

    from detjac.engine import prompt_products
    from detjac.engine.streamed import passes

    events: list[str] = []
    take, layer = prompt_products.Assembled.take, passes.StreamedWalk.layer

    def taking(self, block):
        take(self, block)
        k = sum(e.startswith("take") for e in events)
        events.append(f"take {k}")
        weakref.finalize(block.values, events.append, f"freed {k}")

    def entering(self, i):
        events.append("layer")
        return layer(self, i)

    monkeypatch.setattr(prompt_products.Assembled, "take", taking)
    monkeypatch.setattr(passes.StreamedWalk, "layer", entering)
    sm = StreamedEngine(model)
    result = jacobian(sm, [5, 17, 42], row_block=sm.d_model // 4)
    assert result.jacobian.shape[0] == sm.d_model
    blocks = [e for e in events if e.startswith("take")]
    assert len(blocks) == 4, events
    for k in range(3):  # between taking block k and the next layer entered, block k is freed
        after = events[events.index(f"take {k}") + 1:]
        assert after.index(f"freed {k}") < after.index("layer"), events


def test_text_without_a_tokenizer_is_refused_by_the_streamed_engine_too(model) -> None:
    from detjac.errors import PromptError

    with pytest.raises(PromptError, match="Expected a tokenizer to turn the text prompt into tokens"):
        jacobian(StreamedEngine(model), "The fog")


def _layer_events(monkeypatch, watched) -> list[str]:
    """``load i`` as the layer-streamed walk enters layer i, and ``freed i`` when ``watched(pull)`` (what holds the
    layer's widened weights) is collected."""
    import weakref
    from contextlib import contextmanager

    from detjac.engine.streamed import passes

    events: list[str] = []
    layer = passes.StreamedWalk.layer

    @contextmanager
    def entering(self, i):
        events.append(f"load {i}")
        with layer(self, i) as pull:
            weakref.finalize(watched(pull), events.append, f"freed {i}")
            yield pull

    monkeypatch.setattr(passes.StreamedWalk, "layer", entering)
    return events


def _freed_before_the_next_load(events: list[str]) -> list[int]:
    import itertools

    loads = [k for k, e in enumerate(events) if e.startswith("load")]
    for a, b in itertools.pairwise(loads):
        assert f"freed {events[a].split()[1]}" in events[a:b], events  # freed before the next load
    return loads


def test_a_layer_is_let_go_before_the_next_is_widened(model, monkeypatch) -> None:
    """The budget counts one layer widened to the compute dtype: the reverse sweep lets each layer's pieces go (they
    hold its widened weights) before the next layer is widened."""
    events = _layer_events(monkeypatch, lambda pull: pull)
    sm = StreamedEngine(model)
    jacobian(sm, [5, 17, 42], row_block=sm.d_model // 2)
    assert len(_freed_before_the_next_load(events)) == 2 * sm.n_layers, events  # two blocks


def test_a_graph_lets_each_layer_go_before_the_next_is_widened(model, monkeypatch) -> None:
    """The graph's neuron values, ranking, sites and links walk the layers too: each layer's pieces (its MLP piece
    included, which the neuron walks hand out) are let go before the next layer is widened."""
    from detjac.graphs import attribution_graph

    events = _layer_events(monkeypatch, lambda pull: pull.mlp())  # the MLP piece: its widened weights
    attribution_graph(StreamedEngine(model), [5, 17, 42], GraphSettings(max_nodes=8))
    # values, sites and at least one pullback
    assert len(_freed_before_the_next_load(events)) >= 3 * model.config.num_hidden_layers, events
