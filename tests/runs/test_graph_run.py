"""``detjac run --graph``: each prompt's pruned attribution graph in the store, equal to a direct computation,
resumable, and refused up front where it is not defined."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from store_helpers import write_prompts

from detjac.cli.main import main
from detjac.graph_settings import GraphSettings
from detjac.store import open_store

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [line for line in (ROOT / "examples" / "prompts.txt").read_text().splitlines() if line.strip()][:3]
NODES = "50"  # --graph-max-nodes: small, so the tests are quick


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def graph_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("graph-run")
    prompts = write_prompts(folder / "p.txt", PROMPTS)
    out = folder / "g.zarr"
    result = invoke("run", "default", str(prompts), "--out", str(out), "--graph", "--graph-max-nodes", NODES)
    assert result.exit_code == 0, result.output
    return prompts, out


@pytest.fixture(scope="module")
def engine():
    from detjac.engine import load_engine

    return load_engine("default")


def direct_graph(engine, store, prompt) -> dict:
    """The graph of ``prompt``'s text computed here, outside any run, with the run's settings."""
    from detjac.graphs import attribution_graph, graph_dict

    run = store.run
    keys = ("config_sha256", "weights_sha256", "tokenizer_sha256")
    identity = {k: run[k] for k in keys if isinstance(run.get(k), str)}
    graph = attribution_graph(engine, prompt.prompt, GraphSettings(max_nodes=int(NODES)))
    return graph_dict(graph, slug=prompt.id, model=run["model_id"], identity=identity)


@pytest.mark.slow
def test_each_prompt_keeps_the_graph_a_direct_call_gives(graph_run, engine):
    _, out = graph_run
    store = open_store(out)
    assert store.run["graph"] == {"max_nodes": 50, "node_threshold": 0.8, "edge_threshold": 0.98}
    assert len(store) == len(PROMPTS)
    for prompt in store:
        stored = prompt.graph()
        assert stored is not None and stored["metadata"]["info"]["exact"] is True
        assert stored["metadata"]["info"]["weights_sha256"] == store.run["weights_sha256"]
        assert stored == direct_graph(engine, store, prompt)
    verify = invoke("store", "verify", str(out))
    assert verify.exit_code == 0, verify.output


@pytest.mark.slow
def test_detjac_graph_writes_what_the_run_stores_for_the_same_prompt(graph_run, tmp_path):
    """``detjac graph`` and ``detjac run --graph`` go through one pipeline: the same settings give the same nodes,
    links and model digests (only the slug, the graph's name, differs)."""
    import json

    _, out = graph_run
    prompt = next(iter(open_store(out)))
    written = tmp_path / "g.json"
    result = invoke("graph", "-p", prompt.prompt, "--max-nodes", NODES, "--out", str(written))
    assert result.exit_code == 0, result.output
    alone, stored = json.loads(written.read_text()), prompt.graph()
    assert alone["nodes"] == stored["nodes"] and alone["links"] == stored["links"]
    info = {k: v for k, v in alone["metadata"]["info"].items() if k.endswith("sha256")}
    assert info == {k: v for k, v in stored["metadata"]["info"].items() if k.endswith("sha256")} and len(info) == 3


@pytest.mark.slow
def test_an_interrupted_run_resumes_to_the_same_graphs(graph_run, tmp_path, monkeypatch):
    """Stopped once the second prompt's graph is staged, with what a kill -9 leaves (its staged folder, graph group
    and all), the same run resumes."""
    from detjac.runs import RunOptions, run_corpus
    from detjac.store import ZarrPromptWriter

    prompts, reference = graph_run
    out = tmp_path / "s.zarr"
    options = RunOptions(graph=GraphSettings(max_nodes=int(NODES)))
    real, calls = ZarrPromptWriter.write_graph, []

    def stopped(writer, data):
        real(writer, data)
        calls.append(writer.id)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C between the second prompt's graph and its commit

    def keep_staged(writer):  # as a kill -9: nothing cleans up the staged folder
        pass

    with monkeypatch.context() as patch:
        patch.setattr(ZarrPromptWriter, "write_graph", stopped)
        patch.setattr(ZarrPromptWriter, "abort", keep_staged)
        outcome = run_corpus("default", prompts, str(out), options)
    assert outcome.interrupted and len(open_store(out)) == 1
    assert open_store(out).staging_leftovers()  # the second prompt's half-written folder, graph group and all
    outcome = run_corpus("default", prompts, str(out), options)
    assert not outcome.interrupted and outcome.summary.written == len(PROMPTS) - 1
    resumed, ref = open_store(out), open_store(reference)
    assert sorted(resumed.prompt_ids()) == sorted(ref.prompt_ids())
    for pid in ref.prompt_ids():
        assert resumed.get(pid).graph() == ref.get(pid).graph()
    assert resumed.staging_leftovers() == []


@pytest.mark.slow
def test_a_resume_with_other_graph_settings_is_refused_by_name(graph_run):
    prompts, out = graph_run
    other = invoke("run", "default", str(prompts), "--out", str(out), "--graph", "--graph-max-nodes", "40")
    assert other.exit_code != 0
    assert "--graph-max-nodes 40" in other.output and "--graph-max-nodes 50" in other.output
    without = invoke("run", "default", str(prompts), "--out", str(out))
    assert without.exit_code != 0 and "no --graph here" in without.output
    assert len(open_store(out)) == len(PROMPTS)


def test_graph_with_ordinary_is_refused_before_anything_is_written(tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:1])
    result = invoke("run", "default", str(prompts), "--out", str(tmp_path / "s.zarr"), "--graph", "--ordinary")
    assert result.exit_code != 0 and "Expected --graph without --ordinary" in result.output
    assert not (tmp_path / "s.zarr").exists()


def test_graph_on_a_family_without_neuron_definitions_is_one_line_and_writes_nothing(tmp_path):
    from detjac.engine.checkpoints.tiny import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "bert", "bert")
    prompts = write_prompts(tmp_path / "p.txt", ["The fog rolls over the bay and"])
    result = invoke("run", str(checkpoint), str(prompts), "--out", str(tmp_path / "s.zarr"), "--graph")
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "attribution graphs" in errors[0] and "post-norm" in errors[0]
    assert not (tmp_path / "s.zarr").exists()


def test_an_affine_familys_graph_keeps_its_bias_nodes_through_the_store(tmp_path):
    from detjac.engine.checkpoints.tiny import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "gpt2", "gpt2")
    prompts = write_prompts(tmp_path / "p.txt", ["The fog rolls over the bay and"])
    out = tmp_path / "s.zarr"
    result = invoke("run", str(checkpoint), str(prompts), "--out", str(out), "--graph", "--graph-max-nodes", "30")
    assert result.exit_code == 0, result.output
    prompt = next(iter(open_store(out)))
    graph = prompt.graph()
    kinds = {node["feature_type"] for node in graph["nodes"]}
    assert {"mlp neuron", "bias", "embedding", "logit"} <= kinds
    assert graph["metadata"]["info"]["completeness"] < 1e-12 and graph["metadata"]["info"]["bias_nodes"] > 0
    tables = prompt.graph_arrays()
    assert (tables["node_kind"] == 3).sum() == sum(node["feature_type"] == "bias" for node in graph["nodes"])
    try:
        from circuit_tracer.frontend.graph_models import Model
    except ImportError:
        pytest.skip("circuit-tracer is not installed (pip install --no-deps circuit-tracer==0.5.0)")
    assert len(Model(**graph).nodes) == len(graph["nodes"])


def test_graph_file_from_python_refuses_an_output_inside_the_model_before_loading_it(monkeypatch):
    """The graph pipeline checks its output as the command does (never into what it reads), before any work."""
    from detjac.engine import ModelRef
    from detjac.errors import InvalidArgumentError
    from detjac.model_settings import LoadSpec
    from detjac.runs import graph_file, graph_run

    model = ModelRef.resolve("default")
    before = sorted(p.name for p in model.source.iterdir())
    monkeypatch.setattr(graph_run, "_load", lambda spec: pytest.fail("the model was loaded"))
    with pytest.raises(InvalidArgumentError, match="which this command reads"):
        graph_file(model, "Copper, n. A", LoadSpec(), model.source / "g.json", GraphSettings())
    assert sorted(p.name for p in model.source.iterdir()) == before


def test_a_run_stores_qk_records_as_detjac_graph_computes_them(tmp_path):
    """``--qk`` in a run: the run records the heads, and each prompt's stored graph is the one the graphs layer gives
    for the same settings, its QK record included."""
    from detjac.engine import load_engine
    from detjac.graphs import attribution_graph, graph_dict

    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:1])
    out = tmp_path / "qk.zarr"
    result = invoke("run", "default", str(prompts), "--out", str(out), "--graph", "--graph-max-nodes", "20",
                    "--qk", "2.1")
    assert result.exit_code == 0, result.output
    store = open_store(out)
    assert store.run["graph"] == {"max_nodes": 20, "node_threshold": 0.8, "edge_threshold": 0.98, "qk": [[2, 1]]}
    prompt = next(iter(store))
    stored = prompt.graph()
    assert [n["node_id"].rsplit("_", 1)[0] for n in stored["nodes"] if "qk_tracing_results" in n] == ["A_2_1"]
    run = store.run
    identity = {k: run[k] for k in ("config_sha256", "weights_sha256", "tokenizer_sha256")
                if isinstance(run.get(k), str)}
    graph = attribution_graph(load_engine("default"), prompt.prompt, GraphSettings(max_nodes=20, qk=((2, 1),)))
    assert stored == graph_dict(graph, slug=prompt.id, model=run["model_id"], identity=identity)


def test_qk_heads_a_run_cannot_trace_are_refused_before_anything_is_written(tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:1])
    alone = invoke("run", "default", str(prompts), "--out", str(tmp_path / "a.zarr"), "--qk", "1.0")
    assert alone.exit_code == 2 and "Expected --qk with --graph" in alone.output
    streamed = invoke("run", "default", str(prompts), "--out", str(tmp_path / "s.zarr"), "--graph", "--qk", "1.0",
                      "--streamed")
    assert streamed.exit_code == 1 and "Expected the in-memory engine for --qk" in streamed.output
    far = invoke("run", "default", str(prompts), "--out", str(tmp_path / "f.zarr"), "--graph", "--qk", "7.0")
    assert far.exit_code == 1 and "Got 7.0" in far.output
    assert not any((tmp_path / name).exists() for name in ("a.zarr", "s.zarr", "f.zarr"))
