"""The graph page's data, without a browser: a graph JSON of the default model as the page gets it, a stored
prompt's graph (``StoredPrompt.graph()``) linked from its prompt page and exported, ``detjac view FILE.json``
served and exported, and bad files refused in one line.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
from click.testing import CliRunner
from view_helpers import stored_graphs

from detjac.cli.main import main
from detjac.errors import InvalidArgumentError
from detjac.store import open_store
from detjac.view.graph_file import GraphFile
from detjac.view.graph_page import graph_payload
from detjac.view.pages import NotFound, Pages
from detjac.view.server import make_server
from detjac.view.static_export import export_static


def store_files(path):
    return sorted((str(p.relative_to(path)), p.stat().st_mtime_ns) for p in path.rglob("*"))


def test_the_page_gets_every_node_and_link_with_its_row_and_position(graph_file):
    graph = json.loads(graph_file.read_text())
    page = graph_payload(graph)
    n_layers = graph["metadata"]["info"]["n_layers"]
    assert [n["id"] for n in page["nodes"]] == [n["node_id"] for n in graph["nodes"]]
    assert [(x["source"], x["target"], x["weight"]) for x in page["links"]] == \
        [(x["source"], x["target"], x["weight"]) for x in graph["links"]]
    for mine, theirs in zip(page["nodes"], graph["nodes"], strict=True):
        assert mine["ctx"] == theirs["ctx_idx"] and mine["clerp"] == theirs["clerp"]
        assert mine["influence"] == theirs["influence"] and mine["activation"] == theirs.get("activation")
        kind = theirs["feature_type"]
        expected_row = 0 if kind == "embedding" else n_layers + 2 if kind == "logit" else int(theirs["layer"]) + 1
        assert mine["row"] == expected_row
    assert page["metadata"]["prompt_tokens"] == graph["metadata"]["prompt_tokens"]
    assert page["metadata"]["info"]["exact"] is True


def test_a_file_that_is_not_a_graph_is_refused_in_one_line(graph_file, tmp_path):
    graph = json.loads(graph_file.read_text())
    cases = {"not-json.json": "{nodes", "no-links.json": json.dumps({"nodes": []}),
             "stray-link.json": json.dumps({**graph, "links": [{"source": "E_1_0", "target": "nowhere", "weight": 1}]}),
             "no-position.json": json.dumps({**graph, "nodes": [{"node_id": "x", "layer": "E"}]}),
             "deep.json": "[" * 100_000 + "]" * 100_000,
             "infinite.json": json.dumps({**graph, "nodes": [{"node_id": "x", "layer": 1, "ctx_idx": 0}]}).replace(
                 '"layer": 1', '"layer": Infinity'),
             "digits.json": json.dumps({**graph, "nodes": [{"node_id": "x", "layer": 1, "ctx_idx": 0}]}).replace(
                 '"layer": 1', '"layer": ' + "7" * 5000),
             "huge-layer.json": json.dumps({**graph, "nodes": [{"node_id": "x", "layer": 1e300, "ctx_idx": 0}]}),
             "digit-string.json": json.dumps({**graph, "nodes": [{"node_id": "x", "layer": "7" * 4000, "ctx_idx": 0}]})}
    expected = {"not-json.json": "cannot be read as JSON", "no-links.json": "an object with 'metadata', 'nodes'",
                "stray-link.json": "to join two of its nodes", "no-position.json": "a ctx_idx",
                "deep.json": "values nested too deep to read", "infinite.json": "Infinity, which standard JSON",
                "digits.json": "an integer of 5000 digits", "huge-layer.json": "Expected a node layer 'E' or a number",
                "digit-string.json": "Expected a node layer 'E' or a number"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(InvalidArgumentError, match=expected[name]):
            GraphFile(tmp_path / name)
        result = CliRunner().invoke(main, ["view", str(tmp_path / name)])
        assert result.exit_code != 0 and expected[name] in result.output and "Traceback" not in result.output


def test_a_stored_graph_is_linked_from_its_prompt_and_exported(layered_store, graph_file, tmp_path, monkeypatch):
    graph = json.loads(graph_file.read_text())
    before = store_files(layered_store.path)
    store = open_store(layered_store.path)
    with_graph, without = layered_store.ids[0], layered_store.ids[1]
    assert Pages(store).data(f"prompt/{with_graph}")["graph"] is False  # a reader without graphs: no link
    stored_graphs(monkeypatch, store, {with_graph: graph})
    pages = Pages(store)
    assert pages.data(f"prompt/{with_graph}")["graph"] is True
    assert pages.data(f"prompt/{without}")["graph"] is False
    assert pages.data(f"prompt/{with_graph}/graph") == graph_payload(graph)
    with pytest.raises(NotFound):
        pages.data(f"prompt/{without}/graph")
    keys = list(pages.keys())
    assert f"prompt/{with_graph}/graph" in keys and f"prompt/{without}/graph" not in keys
    written = export_static(store, tmp_path / "pages", [with_graph, without])
    script = (tmp_path / "pages" / "data" / f"prompt.{with_graph}.graph.js").read_text()
    assert tmp_path / "pages" / "data" / f"prompt.{with_graph}.graph.js" in written
    assert json.loads(script.removeprefix(f'detjacData("prompt/{with_graph}/graph", ').removesuffix(");\n")) == \
        graph_payload(graph)
    assert not (tmp_path / "pages" / "data" / f"prompt.{without}.graph.js").exists()
    assert (tmp_path / "pages" / "graph_page.js").read_bytes().startswith(b"// detjac view: an attribution graph")
    assert store_files(layered_store.path) == before  # the store was only read


def test_view_serves_and_exports_one_graph_file(graph_file, tmp_path):
    graph = json.loads(graph_file.read_text())
    server = make_server(GraphFile(graph_file))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        corpus = json.loads(urllib.request.urlopen(server.url + "api/corpus").read())
        served = json.loads(urllib.request.urlopen(server.url + "api/graph").read())
        script = urllib.request.urlopen(server.url + "graph_page.js").read()
    finally:
        server.shutdown()
        server.server_close()
    assert corpus["graph"] == "graph" and corpus["store"]["name"] == "copper.json" and corpus["prompts"] == []
    assert served == graph_payload(graph) and b"GraphPage" in script
    result = CliRunner().invoke(main, ["view", str(graph_file), "--export", str(tmp_path / "g")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "g" / "data").iterdir()) == ["corpus.js", "graph.js"]
