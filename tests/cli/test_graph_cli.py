"""``detjac graph``: the JSON it writes passes circuit-tracer's own models and is served by its own server."""

from __future__ import annotations

import gzip
import json
import re
import socket
import urllib.request

import pytest
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.graph_settings import KEPT_SHARE_MEANING

PROMPT = "Copper, n. A"


def _ct_models():
    try:
        from circuit_tracer.frontend.graph_models import Model  # imports only pydantic
    except ImportError:
        pytest.skip("circuit-tracer is not installed (pip install --no-deps circuit-tracer==0.5.0): its graph "
                    "models and server are not checked")
    return Model


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("graphs")
    out = folder / "copper.json"
    result = CliRunner().invoke(main, ["graph", "-p", PROMPT, "--out", str(out), "--max-nodes", "150"])
    assert result.exit_code == 0, result.output
    return folder, out, result.output


@pytest.mark.slow
def test_graph_prints_an_exact_graph_and_writes_its_json(written):
    folder, out, output = written
    lines = {line.split()[0]: line for line in output.splitlines() if line.strip() and ":" not in line.split()[0]}
    completeness = float(lines["completeness"].split()[1])
    assert completeness < 1e-12
    data = json.loads(out.read_text())
    assert data["metadata"]["schema_version"] == 1 and data["metadata"]["info"]["exact"] is True
    assert data["metadata"]["info"]["weights_sha256"]  # the shipped model's identity
    kinds = {n["feature_type"] for n in data["nodes"]}
    assert kinds == {"embedding", "mlp neuron", "logit"}  # no error nodes
    ids = {n["node_id"] for n in data["nodes"]}
    assert all(link["source"] in ids and link["target"] in ids for link in data["links"])
    assert sum(n["feature_type"] == "embedding" for n in data["nodes"]) == len(data["metadata"]["prompt_tokens"])
    index = json.loads((folder / "graph-metadata.json").read_text())
    assert [g["slug"] for g in index["graphs"]] == ["copper"]
    shares = [float(s) for s in re.findall(r" (-?\d+\.\d\d)(?:,|$)", lines["kept"])]  # each logit's, named
    assert shares == pytest.approx(data["metadata"]["info"]["logit_share_kept"], abs=0.006)
    logits = [n for n in data["nodes"] if n["feature_type"] == "logit"]
    assert lines["kept"].count("'") >= 2 * len(logits) and len(shares) == len(logits)
    assert " ".join(KEPT_SHARE_MEANING.split()) in " ".join(output.split())  # what a share, negative too, means


@pytest.mark.slow
def test_the_json_passes_circuit_tracers_models_and_server(written):
    Model = _ct_models()
    from circuit_tracer.frontend.local_server import serve

    folder, out, _ = written
    model = Model(**json.loads(out.read_text()))
    assert len(model.nodes) == len(json.loads(out.read_text())["nodes"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = serve(str(folder), port=port)
    try:
        for path, check in (("/data/graph-metadata.json", lambda d: d["graphs"][0]["slug"] == "copper"),
                            ("/graph_data/copper.json", lambda d: Model(**d).metadata.slug == "copper")):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
                body = response.read()
                if response.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
            assert check(json.loads(body)), path
    finally:
        server.stop()


def test_bad_output_paths_are_refused_before_any_work(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["graph", "-p", PROMPT, "--out", str(tmp_path / "g.txt")])
    assert result.exit_code != 0 and "Expected a path ending in .json. Got" in result.output
    existing = tmp_path / "g.json"
    existing.write_text("{}")
    result = runner.invoke(main, ["graph", "-p", PROMPT, "--out", str(existing)])
    assert result.exit_code != 0 and "exists (--force replaces it)" in result.output
    assert existing.read_text() == "{}"


def test_qk_records_travel_in_a_graph_circuit_tracers_models_still_read(tmp_path):
    out = tmp_path / "qk.json"
    result = CliRunner().invoke(main, ["graph", "-p", PROMPT, "--out", str(out), "--max-nodes", "30", "--qk", "1.0",
                                       "--qk", "L3.H2"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    traced = [n for n in data["nodes"] if "qk_tracing_results" in n]
    assert [n["node_id"].rsplit("_", 1)[0] for n in traced] == ["A_1_0", "A_3_2"]
    assert [line.split(":")[0] for line in result.output.splitlines() if line.startswith("qk ")] == [
        f"qk           L1.H0 at “{data['metadata']['prompt_tokens'][-1]}”", f"qk           L3.H2 at "
        f"“{data['metadata']['prompt_tokens'][-1]}”"]
    Model = _ct_models()
    assert len(Model(**data).nodes) == len(data["nodes"])  # circuit-tracer's page reads the QK-only nodes too
    bad = CliRunner().invoke(main, ["graph", "-p", PROMPT, "--out", str(tmp_path / "b.json"), "--qk", "three"])
    assert bad.exit_code == 2 and "Expected a head as LAYER.HEAD (e.g. 3.1 or L3.H1). Got 'three'." in bad.output
