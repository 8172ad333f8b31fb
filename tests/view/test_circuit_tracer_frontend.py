"""circuit-tracer's own frontend draws a detjac graph, in headless Chromium, with its CDN libraries replaced by
local npm packages (``tests/view/ct_frontend.py`` says which, and the glue they need).

Skipped, with one line, without chromium, circuit-tracer 0.5.0 or the npm packages (``make ct-frontend-libs``).
"""

from __future__ import annotations

import json
import shutil
import socket
import time

import pytest
from ct_frontend import libs_missing, offline_frontend

from detjac.view.headless import INSTALL, browser_missing

if browser_missing() or libs_missing():  # one line in the summary for the whole module, never a silent pass
    pytest.skip(f"circuit-tracer's page needs {browser_missing() or libs_missing()}"
                f"{': ' + INSTALL if browser_missing() else ''}", allow_module_level=True)

pytestmark = pytest.mark.browser
WAIT = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(driver, script, done):
    """The value of ``script`` in the page once ``done(value)`` holds (or the last one after WAIT seconds)."""
    deadline = time.monotonic() + WAIT
    while True:
        value = driver.execute_script(script)
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_circuit_tracers_page_draws_a_detjac_graph_offline(browser, graph_file, tmp_path):
    from circuit_tracer.frontend.local_server import serve

    graph = json.loads(graph_file.read_text())
    data = tmp_path / "data"
    data.mkdir()
    shutil.copyfile(graph_file, data / graph_file.name)
    shutil.copyfile(graph_file.parent / "graph-metadata.json", data / "graph-metadata.json")
    slug = graph["metadata"]["slug"]
    port = free_port()
    server = serve(str(data), frontend_dir=offline_frontend(tmp_path / "frontend"), port=port)
    try:
        browser.get(f"http://localhost:{port}/index.html?slug={slug}")
        drawn = until(browser, "return d3.selectAll('text.node').data().map(d => d.nodeId)", bool)
        # its pruning slider starts at the graph's node_threshold and hides neurons whose influence exceeds it
        threshold = graph["metadata"]["node_threshold"]
        assert set(drawn) == {n["node_id"] for n in graph["nodes"]
                              if n["feature_type"] != "mlp neuron" or n["influence"] <= threshold}
        assert len(drawn) > len(graph["nodes"]) // 2
        tokens = browser.execute_script("return d3.selectAll('.prompt-token text').nodes().map(n => n.textContent)")
        assert tokens and set(tokens) <= set(graph["metadata"]["prompt_tokens"])
        node = next(n["node_id"] for n in graph["nodes"] if n["feature_type"] == "mlp neuron" and n["node_id"] in drawn
                    and any(x["source"] == n["node_id"] for x in graph["links"]))
        browser.get(f"http://localhost:{port}/index.html?slug={slug}&clickedId={node}")
        rows = "return d3.selectAll('.features.{} .feature-row').data().map(d => d.nodeId)"
        inputs = until(browser, rows.format("input"), bool)
        outputs = until(browser, rows.format("output"), bool)
        assert set(inputs) == {x["source"] for x in graph["links"] if x["target"] == node}
        assert set(outputs) == {x["target"] for x in graph["links"] if x["source"] == node}
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and "favicon.ico" not in e["message"]]
        assert errors == []  # its server has no favicon: the one 404 that is not the page's
    finally:
        server.stop()
