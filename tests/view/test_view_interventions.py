"""The live viewer's interventions (docs/graphs.md, "Interventions"): runs/' handler on the default model behind the
server's one POST, ``/api/intervene``; no browser. Answers equal the engine's own; bad bodies come back as JSON errors
that say what was expected; a viewer without a model, and a static export, say that interventions need the live
viewer started with ``--model``."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from detjac.engine import Edit, intervene
from detjac.errors import InvalidArgumentError
from detjac.runs import load_interventions
from detjac.view import GraphFile, graph_token_ids, make_server


@pytest.fixture(scope="module")
def handler(graph_file):
    meta = GraphFile(graph_file).graph
    return load_interventions("default", meta["metadata"]["prompt"], meta["metadata"]["prompt_tokens"],
                              graph_token_ids(meta["nodes"]))


def _serve(graph_file, interventions):
    server = make_server(GraphFile(graph_file), interventions=interventions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def live(graph_file, handler):
    server = _serve(graph_file, handler)
    yield server
    server.shutdown()
    server.server_close()


def _post(server, body, kind="application/json"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.url + "api/intervene", data=data, method="POST",
                                     headers={"Content-Type": kind})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_an_answer_is_the_engine_s_own_with_both_columns(live, handler):
    edit = {"kind": "neuron", "layer": 1, "index": 5, "position": 2, "mode": "clamp", "value": 4.0}
    status, got = _post(live, {"edits": [edit, {"kind": "head", "layer": 0, "index": 1, "position": 3}], "top_k": 4})
    assert status == 200, got
    want = intervene(handler.engine, handler.ids, [Edit(**edit), Edit("head", 0, 1, 3)], top_k=4)
    for column in ("before", "linear", "real"):
        assert got[column]["token_ids"] == getattr(want, column).token_ids
        assert got[column]["logits"] == pytest.approx(getattr(want, column).logits, rel=1e-12)
        assert len(got[column]["tokens"]) == 4
    assert got["target"] == want.target and got["edits"][1]["mode"] == "zero"
    assert got["linear"]["target_change"] == pytest.approx(want.linear.target_change, rel=1e-12)


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"edits": []}, 422, "Expected 'edits' a list of 1 to 64 edits. Got 0 edits"),
    ({"edits": [{"kind": "neuron", "layer": 99, "index": 0, "position": 0}]}, 422, "Expected a layer in [0, "),
    ({"edits": [{"kind": "head", "layer": 0, "index": 0, "position": 999}]}, 422, "Expected a position in [0, "),
    ({"edits": [{"kind": "head", "layer": "0", "index": 0, "position": 0}]}, 422, "'layer' an integer. Got '0'"),
    ({"edits": [{"kind": "head", "layer": 0, "index": 0}]}, 422, "Got no 'position'"),
    ({"edits": [{"kind": "head", "layer": 0, "index": 0, "position": 0}], "top_k": 51}, 422, "'top_k' an integer"),
    ({"edits": [{"kind": "head", "layer": 0, "index": 0, "position": 0, "x": 1}]}, 422, "Got unknown 'x'"),
    ([1, 2], 422, "Expected a JSON object with 'edits'. Got list"),
    (b"{not json", 400, "Expected a JSON body."),
    (b"x" * (64 * 1024 + 1), 413, "Expected a body of at most 65536 bytes"),
])
def test_bad_bodies_come_back_as_json_errors(live, body, status, words):
    got_status, got = _post(live, body)
    assert got_status == status and words in got["error"] and "Got" in got["error"]


def test_only_json_bodies_are_read(live):
    status, got = _post(live, {"edits": []}, kind="text/plain")
    assert status == 415 and "Expected a body of type application/json" in got["error"]


def test_a_viewer_without_a_model_says_what_interventions_need(graph_file):
    server = _serve(graph_file, None)
    try:
        status, got = _post(server, {"edits": [{"kind": "head", "layer": 0, "index": 0, "position": 0}]})
    finally:
        server.shutdown()
        server.server_close()
    assert status == 404 and "live viewer started with the model" in got["error"] and "--model" in got["error"]


def test_another_model_s_graph_is_refused_at_start(graph_file):
    meta = GraphFile(graph_file).graph["metadata"]
    with pytest.raises(InvalidArgumentError, match="Expected a model that reads the graph's prompt"):
        load_interventions("default", meta["prompt"], [*meta["prompt_tokens"], " extra"], {})


def test_model_is_refused_where_no_live_graph_viewer_runs(graph_file, layered_store, tmp_path):
    from click.testing import CliRunner

    from detjac.cli.main import main

    export = CliRunner().invoke(main, ["view", str(graph_file), "--model", "default", "--export", str(tmp_path / "p")])
    assert export.exit_code == 2 and "--model applies to the live viewer only" in export.output
    assert not (tmp_path / "p").exists()
    store = CliRunner().invoke(main, ["view", str(layered_store.path), "--model", "default"])
    assert store.exit_code == 2 and "--model applies to a graph JSON file" in store.output
