"""``detjac store export ID --out g.json`` and ``detjac analyze graphs`` on a real ``detjac run --graph`` store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.store import open_store
from detjac.store.testing import make_store

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [line for line in (ROOT / "examples" / "prompts.txt").read_text().splitlines() if line.strip()][:2]


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def graph_store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("graph-store")
    prompts = folder / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    result = invoke("run", "default", str(prompts), "--out", str(folder / "g.zarr"), "--graph", "--graph-max-nodes",
                    "50")
    assert result.exit_code == 0, result.output
    return folder, open_store(folder / "g.zarr")


@pytest.mark.slow
def test_export_writes_the_stored_graph_as_circuit_tracer_json(graph_store):
    folder, store = graph_store
    pid = store.prompt_ids()[0]
    out = folder / "graph.json"
    result = invoke("store", "export", str(store.path), pid, "--out", str(out))
    assert result.exit_code == 0, result.output
    data, stored = json.loads(out.read_text()), store.get(pid).graph()
    assert data["metadata"]["slug"] == "graph" and stored["metadata"]["slug"] == pid  # as circuit-tracer serves it
    assert {**data, "metadata": stored["metadata"]} == stored
    assert {**data["metadata"], "slug": pid} == stored["metadata"]
    index = json.loads((folder / "graph-metadata.json").read_text())
    assert [g["slug"] for g in index["graphs"]].count("graph") == 1
    try:
        from circuit_tracer.frontend.graph_models import Model
    except ImportError:
        pytest.skip("circuit-tracer is not installed (pip install --no-deps circuit-tracer==0.5.0)")
    model = Model(**data)
    assert len(model.nodes) == len(data["nodes"]) and len(model.links) == len(data["links"])
    again = invoke("store", "export", str(store.path), pid, "--out", str(out))
    assert again.exit_code != 0 and "exists" in again.output  # replaced only with --force
    assert invoke("store", "export", str(store.path), pid, "--out", str(out), "--force").exit_code == 0
    other = store.prompt_ids()[1]
    assert invoke("store", "export", str(store.path), other, "--out", str(folder / "second.json")).exit_code == 0
    index = json.loads((folder / "graph-metadata.json").read_text())
    assert sorted(g["slug"] for g in index["graphs"] if g["slug"] in ("graph", "second")) == ["graph", "second"]


@pytest.mark.slow
def test_analyze_graphs_on_a_run_counts_what_the_graphs_hold(graph_store):
    folder, store = graph_store
    table = folder / "neurons.csv"
    result = invoke("analyze", "graphs", str(store.path), "--table", str(table))
    assert result.exit_code == 0, result.output
    graphs = [store.get(pid).graph() for pid in store.prompt_ids()]
    per_graph = [{tuple(n["node_id"].split("_")[:2]) for n in g["nodes"] if n["feature_type"] == "mlp neuron"}
                 for g in graphs]
    in_both = per_graph[0] & per_graph[1]
    import csv

    rows = list(csv.DictReader(table.open()))
    assert len(rows) == len(per_graph[0] | per_graph[1])
    assert {(r["layer"], r["index"]) for r in rows if r["graphs"] == "2"} == in_both
    assert f"{len(rows)} neurons in 2 graphs" in result.output


def test_export_of_a_prompt_stored_without_a_graph_is_refused(tmp_path):
    made = make_store(tmp_path / "s.zarr", prompts=1)
    pid = made.ids[0]
    result = invoke("store", "export", str(made.path), pid, "--out", str(tmp_path / "g.json"))
    assert result.exit_code == 1 and "stored without one" in result.output
    assert not (tmp_path / "g.json").exists()
