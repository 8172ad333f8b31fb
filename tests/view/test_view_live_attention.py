"""A live ``detjac view`` of a graph file notices the attention files written beside it after it started: a new file's
page is served and the graph links it; a rewritten one is read again; a damaged one is every page's error (never
numbers) until it is removed; files given with --attention stay. Synthetic files, an in-process server: no model."""

from __future__ import annotations

import http.client
import json
import os
import threading
from contextlib import contextmanager

from test_graph_heads import qk_file, small_graph

from detjac.view import GraphFile, make_server


@contextmanager
def serving(graph, attention=()):
    server = make_server(GraphFile(graph, attention), attention=attention)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def get(server, key):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", f"/api/{key}", headers={"Host": f"127.0.0.1:{server.port}"})
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    return response.status, body


def test_attention_files_written_after_the_viewer_started_are_served(tmp_path):
    graph = tmp_path / "g.json"
    graph.write_text(json.dumps(small_graph()))
    (tmp_path / "elsewhere").mkdir()
    given = tmp_path / "elsewhere" / "qk.json"
    given.write_text(json.dumps(qk_file(head=3)))
    with serving(graph, [given]) as server:
        assert get(server, "graph")[1]["metadata"]["attention"] == ["attention/2.3.2"]
        assert get(server, "attention/2.1.2")[0] == 404
        (tmp_path / "g.qk.L2.H1.json").write_text(json.dumps(qk_file()))
        status, page = get(server, "attention/2.1.2")
        assert status == 200 and page["file"] == "g.qk.L2.H1.json" and page["keys"][0]["score"] == \
            qk_file()["keys"][0]["score"]
        assert get(server, "graph")[1]["metadata"]["attention"] == ["attention/2.1.2", "attention/2.3.2"]
        rewritten = qk_file()
        for key in rewritten["keys"]:  # another file of the same head: every value doubled
            key["score"] *= 2
            for term in key["terms"]:
                term["value"] *= 2
        (tmp_path / "g.qk.L2.H1.json").write_text(json.dumps(rewritten))
        os.utime(tmp_path / "g.qk.L2.H1.json", ns=(1, 1))  # a rewrite within the clock's tick is noticed too
        assert get(server, "attention/2.1.2")[1]["keys"][0]["score"] == rewritten["keys"][0]["score"]
        damaged = qk_file()
        damaged["keys"][1]["terms"][0]["value"] = 9.0
        (tmp_path / "g.qk.L2.H1.json").write_text(json.dumps(damaged))
        for key in ("graph", "attention/2.1.2", "attention/2.3.2"):
            status, body = get(server, key)
            assert status == 422 and "g.qk.L2.H1.json" in body["error"] and "sum to its score" in body["error"]
        (tmp_path / "g.qk.L2.H1.json").unlink()
        assert get(server, "graph")[1]["metadata"]["attention"] == ["attention/2.3.2"]
        assert get(server, "attention/2.1.2")[0] == 404
