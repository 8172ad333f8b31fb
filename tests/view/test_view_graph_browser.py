"""The graph page in a real headless Chromium: a default-model graph draws every node and link where it belongs,
a click shows a node's labels and edges, the thresholds change what is shown, labels with markup stay text, and a
store's graph is linked from its prompt and opens from a static export.

Needs chromium, chromedriver and selenium (skipped otherwise, saying so; see ``detjac.view.headless``).
"""

from __future__ import annotations

import json
import threading

import pytest
from test_view_browser import css, wait_for
from view_helpers import INJECTED, kept_by_thresholds, stored_graphs

from detjac.graph_settings import GraphSettings
from detjac.store import open_store
from detjac.view.headless import INSTALL, Served, browser_missing
from detjac.view.server import make_server
from detjac.view.static_export import export_static

if browser_missing():  # one line in the summary for the whole module, never a silent pass
    pytest.skip(f"browser tests need {browser_missing()}: {INSTALL}", allow_module_level=True)

pytestmark = pytest.mark.browser


def set_threshold(driver, which, value):
    """Move the slider ``which`` (``node`` or ``edge``) to ``value`` as a user would: its value, then an input event."""
    slider = css(driver, f"#{which}-threshold")[0]
    driver.execute_script("arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input'));",
                          slider, str(value))


def drawn(driver):
    """What the graph's SVG holds, read in one call: each node's id and centre, each link's ends and colour."""
    return driver.execute_script("""
        const nodes = [...document.querySelectorAll('#graph-svg .node')].map((n) => {
          const b = n.getBBox(); return [n.dataset.id, b.x + b.width / 2, b.y + b.height / 2]; });
        const links = [...document.querySelectorAll('#graph-svg .link')].map((l) =>
          [l.dataset.source, l.dataset.target, l.getAttribute('stroke')]);
        return {nodes, links};""")


def shown(driver):
    """The node ids and (source, target) of the links drawn."""
    found = drawn(driver)
    return {n[0] for n in found["nodes"]}, {(s, t) for s, t, _ in found["links"]}


def test_a_graph_file_draws_every_node_and_link_by_layer_and_position(browser, graph_served, graph):
    browser.get(graph_served.url)
    wait_for(browser, "#graph-svg .node", len(graph["nodes"]))
    nodes, links = shown(browser)
    assert nodes == {n["node_id"] for n in graph["nodes"]} and len(css(browser, "#graph-svg .node")) == len(nodes)
    assert links == {(x["source"], x["target"]) for x in graph["links"]}
    assert len(css(browser, "#graph-svg .link")) == len(graph["links"])
    assert [e.get_attribute("textContent") for e in css(browser, "#graph-svg .col-label title")] == \
        [f"token {k}: {t}" for k, t in enumerate(graph["metadata"]["prompt_tokens"])]
    found = drawn(browser)
    at = {node_id: (x, y) for node_id, x, y in found["nodes"]}
    rank = {"embedding": -1, "logit": 10**6}
    level = {n["node_id"]: rank.get(n["feature_type"], int(n["layer"]) if n["layer"] != "E" else -1)
             for n in graph["nodes"]}
    for a in graph["nodes"]:  # a higher layer is drawn higher up; a later position further right
        for b in graph["nodes"]:
            if level[a["node_id"]] < level[b["node_id"]]:
                assert at[a["node_id"]][1] > at[b["node_id"]][1], (a["node_id"], b["node_id"])
            if a["ctx_idx"] < b["ctx_idx"]:
                assert at[a["node_id"]][0] < at[b["node_id"]][0], (a["node_id"], b["node_id"])
    signs = {(source, target): stroke for source, target, stroke in found["links"]}
    assert {signs[(x["source"], x["target"])] for x in graph["links"] if x["weight"] > 0} == {"#2a62b8"}
    assert {signs[(x["source"], x["target"])] for x in graph["links"] if x["weight"] < 0} == {"#d0543e"}
    assert [log for log in browser.get_log("browser") if log["level"] == "SEVERE"] == []


def test_a_click_shows_the_nodes_labels_and_edges(browser, graph_served, graph):
    browser.get(graph_served.url)
    wait_for(browser, "#graph-svg .node", len(graph["nodes"]))
    degree = {}
    for x in graph["links"]:
        degree[x["target"]] = degree.get(x["target"], 0) + 1
    node = next(n for n in graph["nodes"]  # a neuron with edges both ways
                if n["feature_type"] == "mlp neuron" and degree.get(n["node_id"], 0) >= 2
                and any(x["source"] == n["node_id"] for x in graph["links"]))
    css(browser, f'#graph-svg .node[data-id="{node["node_id"]}"]')[0].click()
    wait_for(browser, "#incoming tbody tr")
    assert css(browser, "#node-label")[0].text == node["clerp"]
    facts = {e.get_attribute("data-fact"): e.text for e in css(browser, "#node-facts dd")}
    assert float(facts["activation"]) == pytest.approx(node["activation"], rel=1e-5)
    assert float(facts["influence"]) == pytest.approx(node["influence"], rel=1e-3)
    rows = lambda table: sorted((r.get_attribute("data-id"), float(r.find_elements("css selector", "td")[2].text))  # noqa: E731
                                for r in css(browser, f"#{table} tbody tr"))
    incoming = sorted((x["source"], x["weight"]) for x in graph["links"] if x["target"] == node["node_id"])
    outgoing = sorted((x["target"], x["weight"]) for x in graph["links"] if x["source"] == node["node_id"])
    assert [i for i, _ in rows("incoming")] == [i for i, _ in incoming]
    assert [w for _, w in rows("incoming")] == pytest.approx([w for _, w in incoming], rel=1e-3)
    assert [i for i, _ in rows("outgoing")] == [i for i, _ in outgoing]
    highlighted = {(x.get_attribute("data-source"), x.get_attribute("data-target"))
                   for x in css(browser, "#graph-svg .link.hl")}
    drivers = {r.get_attribute("data-id") for r in css(browser, "#drivers-table tbody tr")}  # what drives it
    assert drivers and highlighted == {(s, node["node_id"]) for s, _ in incoming if s in drivers}
    token = next(n["node_id"] for n in graph["nodes"] if n["feature_type"] == "embedding"  # no drivers: every edge
                 and any(x["source"] == n["node_id"] for x in graph["links"]))
    css(browser, f'#graph-svg .node[data-id="{token}"]')[0].click()
    lit = {(x.get_attribute("data-source"), x.get_attribute("data-target"))
           for x in css(browser, "#graph-svg .link.hl")}
    assert lit == {(x["source"], x["target"]) for x in graph["links"] if x["source"] == token}
    css(browser, f'#graph-svg .node[data-id="{node["node_id"]}"]')[0].click()
    source = incoming[0][0]  # an edge's row leads to the node at its other end
    css(browser, f'#incoming tbody tr[data-id="{source}"]')[0].click()
    assert css(browser, "#graph-svg .node.selected")[0].get_attribute("data-id") == source


def test_the_thresholds_change_what_is_shown(browser, graph_served, graph):
    browser.get(graph_served.url)
    wait_for(browser, "#graph-svg .node", len(graph["nodes"]))
    for node_t, edge_t in ((0.5, 1.0), (0.5, 0.6), (1.0, 0.3), (0.2, 0.9)):
        set_threshold(browser, "node", node_t)
        set_threshold(browser, "edge", edge_t)
        nodes, links = kept_by_thresholds(graph, node_t, edge_t)
        assert len(nodes) < len(graph["nodes"]) or len(links) < len(graph["links"])  # the check can fail
        assert shown(browser) == (nodes, {(x["source"], x["target"]) for x in links})
        assert css(browser, "#node-threshold-value")[0].text == f"{node_t:.2f}"
    set_threshold(browser, "node", 1)
    set_threshold(browser, "edge", 1)
    assert len(css(browser, "#graph-svg .node")) == len(graph["nodes"])
    assert len(css(browser, "#graph-svg .link")) == len(graph["links"])


def test_an_affine_familys_bias_nodes_are_drawn_and_shown(browser, tmp_path):
    import torch

    from detjac.engine import InMemoryEngine, tiny_model
    from detjac.graphs import attribution_graph, write_graph

    model = tiny_model("gpt2", seed=3).to(torch.float64)
    data = write_graph(attribution_graph(InMemoryEngine(model), [3, 17, 5, 42, 9, 11], GraphSettings(max_nodes=20)),
                       tmp_path / "gpt2.json", model="tiny-gpt2", node_threshold=1.0, edge_threshold=1.0)
    biases = [n for n in data["nodes"] if n["feature_type"] == "bias"]
    assert biases
    server = Served(tmp_path / "gpt2.json")
    try:
        browser.get(server.url)
        wait_for(browser, "#graph-svg .node", len(data["nodes"]))
        assert len(css(browser, "#graph-svg .node-bias polygon")) == len(biases)
        bias = max(biases, key=lambda n: sum(abs(x["weight"]) for x in data["links"] if x["source"] == n["node_id"]))
        css(browser, f'#graph-svg .node[data-id="{bias["node_id"]}"]')[0].click()
        wait_for(browser, "#outgoing tbody tr")
        assert css(browser, "#node-label")[0].text == bias["clerp"] and bias["clerp"].startswith("Bias: ")
        outgoing = [x for x in data["links"] if x["source"] == bias["node_id"]]
        assert len(css(browser, "#outgoing tbody tr")) == len(outgoing)
    finally:
        server.stop()


def test_markup_in_token_texts_and_labels_is_shown_as_text(browser, graph, tmp_path):
    from selenium.common.exceptions import NoAlertPresentException

    bad = json.loads(json.dumps(graph))
    bad["metadata"]["prompt_tokens"][1] = INJECTED
    bad["metadata"]["prompt"] = INJECTED
    token = next(n for n in bad["nodes"] if n["feature_type"] == "embedding" and n["ctx_idx"] == 1)
    neuron = next(n for n in bad["nodes"] if n["feature_type"] == "mlp neuron")
    token["clerp"], neuron["clerp"] = INJECTED, "<script>alert(1)</script>" + INJECTED
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    server = Served(tmp_path / "bad.json")
    try:
        browser.get(server.url)
        wait_for(browser, "#graph-svg .node", len(bad["nodes"]))
        assert css(browser, "#prompt-text")[0].text == INJECTED
        assert css(browser, '#graph-svg .col-label[data-index="1"] title')[0].get_attribute("textContent") == \
            f"token 1: {INJECTED}"
        css(browser, f'#graph-svg .node[data-id="{neuron["node_id"]}"]')[0].click()
        wait_for(browser, "#node-label")
        assert css(browser, "#node-label")[0].text == neuron["clerp"]
        css(browser, f'#graph-svg .node[data-id="{token["node_id"]}"]')[0].click()
        wait_for(browser, "#outgoing tbody tr")
        assert css(browser, "#node-label")[0].text == f"token 1 {json.dumps(INJECTED)}"  # the token, quoted
        assert css(browser, "img") == [] and css(browser, "main script") == []  # no element was made from a label
        assert browser.title == "detjac view"
        with pytest.raises(NoAlertPresentException):
            browser.switch_to.alert.text  # noqa: B018 - raises when no alert() ran
    finally:
        server.stop()


def test_a_stored_graph_is_a_tab_of_its_prompt_live_and_in_the_export(browser, layered_store, graph, tmp_path,
                                                                       monkeypatch):
    store = open_store(layered_store.path)
    pid, other = layered_store.ids[0], layered_store.ids[1]
    stored_graphs(monkeypatch, store, {pid: graph})  # StoredPrompt.graph(), as the store's graphs come
    server = make_server(store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        browser.get(server.url + f"#/prompt/{other}")
        wait_for(browser, "#tabs a[data-tab]")
        assert css(browser, '#tabs a[data-tab="graph"]') == []  # no graph, no tab
        browser.get(server.url + f"#/prompt/{pid}")
        wait_for(browser, '#tabs a[data-tab="graph"]')[0].click()
        wait_for(browser, "#graph-svg .node", len(graph["nodes"]))
        assert browser.current_url.endswith(f"#/prompt/{pid}/graph")
        live = shown(browser)
    finally:
        server.shutdown()
        server.server_close()
    export_static(store, tmp_path / "pages", [pid, other])
    browser.get((tmp_path / "pages" / "index.html").as_uri() + f"#/prompt/{pid}")
    wait_for(browser, '#tabs a[data-tab="graph"]')[0].click()
    wait_for(browser, "#graph-svg .node", len(graph["nodes"]))
    assert shown(browser) == live and len(live[1]) == len(graph["links"])
    set_threshold(browser, "node", 0.3)
    assert len(css(browser, "#graph-svg .node")) == len(kept_by_thresholds(graph, 0.3, 1.0)[0]) < len(graph["nodes"])


def test_a_graph_files_export_opens_from_disk(browser, graph_file, graph, tmp_path):
    from click.testing import CliRunner

    from detjac.cli.main import main

    result = CliRunner().invoke(main, ["view", str(graph_file), "--export", str(tmp_path / "pages")])
    assert result.exit_code == 0, result.output
    browser.get((tmp_path / "pages" / "index.html").as_uri())
    wait_for(browser, "#graph-svg .node", len(graph["nodes"]))
    links = {(x["source"], x["target"]) for x in graph["links"]}
    assert shown(browser) == ({n["node_id"] for n in graph["nodes"]}, links)
    assert css(browser, "#prompt-text")[0].text == graph["metadata"]["prompt"]
