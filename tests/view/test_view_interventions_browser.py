"""The graph page's interventions panel in a real headless Chromium: a neuron picked on the graph and a head given by
number, ablated together; the three columns shown are the engine's own (``detjac view GRAPH.json --model default``);
a viewer without a model and a static export say that interventions need the live viewer with ``--model``. Needs
chromium, chromedriver and selenium (skipped otherwise, saying so).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_view_browser import css, wait_for

from detjac.cli.main import main
from detjac.engine import Edit, intervene, load_engine
from detjac.view.headless import INSTALL, Served, browser_missing

if browser_missing():  # one line in the summary for the whole module, never a silent pass
    pytest.skip(f"browser tests need {browser_missing()}: {INSTALL}", allow_module_level=True)

pytestmark = pytest.mark.browser
NEED = "Interventions need the live viewer started with the model: detjac view GRAPH.json --model MODEL."


@pytest.fixture(scope="module")
def live(graph_file):
    server = Served(graph_file, "--model", "default")
    yield server
    server.stop()


def _neuron(graph):
    """The graph's first neuron node's id and its edit."""
    node = next(n for n in graph["nodes"] if n["feature_type"] == "mlp neuron")
    layer, index, position = map(int, node["node_id"].split("_"))
    return node["node_id"], Edit("neuron", layer, index, position)


def test_the_panel_shows_both_columns_of_an_ablation(browser, live, graph):
    node, edit = _neuron(graph)
    browser.get(live.url)
    wait_for(browser, "#graph-svg .node", len(graph["nodes"]))
    css(browser, f'#graph-svg .node[data-id="{node}"]')[0].click()
    css(browser, "#intervene-add-selected")[0].click()
    for name, v in (("layer", "1"), ("head", "2"), ("position", "1")):
        css(browser, f"#intervene-head-{name}")[0].send_keys(v)
    css(browser, "#intervene-add-head")[0].click()
    assert [li.get_attribute("data-edit") for li in css(browser, "#intervene-edits li")] == \
        [f"neuron {edit.layer}.{edit.index} at {edit.position}", "head 1.2 at 1"]
    css(browser, "#intervene-run")[0].click()
    wait_for(browser, "#intervene-real tbody tr", 10)
    engine = load_engine("default")
    want = intervene(engine, [int(n["node_id"].split("_")[1]) for n in sorted(
        (n for n in graph["nodes"] if n["feature_type"] == "embedding"), key=lambda n: n["ctx_idx"])],
        [edit, Edit("head", 1, 2, 1)], top_k=10)
    for name in ("before", "linear", "real"):
        rows = css(browser, f"#intervene-{name} tbody tr")
        assert [int(r.get_attribute("data-token-id")) for r in rows] == getattr(want, name).token_ids
        assert [r.find_element("css selector", "td.text").text for r in rows] == \
            [json.dumps(t) for t in getattr(want, name).tokens]  # texts set as text, quoted
    assert float(css(browser, "#intervene-change-linear")[0].text) == pytest.approx(want.linear.target_change,
                                                                                     rel=1e-3, abs=1e-6)
    assert [log for log in browser.get_log("browser") if log["level"] == "SEVERE"] == []


def test_a_viewer_without_a_model_says_what_interventions_need(browser, graph_served, graph):
    browser.get(graph_served.url)
    wait_for(browser, "#graph-svg .node", len(graph["nodes"]))
    css(browser, "#intervene-head-layer")[0].send_keys("0")
    css(browser, "#intervene-head-head")[0].send_keys("0")
    css(browser, "#intervene-head-position")[0].send_keys("0")
    css(browser, "#intervene-add-head")[0].click()
    css(browser, "#intervene-run")[0].click()
    assert _answered(browser) == NEED and css(browser, "#intervene-result table") == []


def _answered(driver):
    """The panel's note once the server has answered."""
    from selenium.webdriver.support.ui import WebDriverWait

    def done(d):
        text = css(d, "#intervene-note")[0].text
        return text if text and text != "computing…" else False

    return WebDriverWait(driver, 60).until(done)


def test_a_static_export_says_what_interventions_need(browser, graph_file, tmp_path):
    result = CliRunner().invoke(main, ["view", str(graph_file), "--export", str(tmp_path / "pages")])
    assert result.exit_code == 0, result.output
    browser.get((tmp_path / "pages" / "index.html").as_uri())
    note = wait_for(browser, "#interventions #intervene-note")[0]
    assert note.text == NEED + " This page is a static export."
    assert css(browser, "#intervene-run") == []
