"""The graph page's target panel in a real headless Chromium: a contrast with the first position set aside lists
every token's signed contribution, largest first, sortable, with their sum beside the target's value and the
set-aside said; a graph of the top logits gets one button per logit; tokens with markup stay text.

Needs chromium, chromedriver and selenium (skipped otherwise, saying so; see ``detjac.view.headless``).
"""

from __future__ import annotations

import pytest
from test_view_browser import css, wait_for

from detjac.engine import load_engine
from detjac.graph_settings import GraphSettings
from detjac.graphs import attribution_graph, write_graph
from detjac.view.headless import INSTALL, Served, browser_missing

if browser_missing():  # one line in the summary for the whole module, never a silent pass
    pytest.skip(f"browser tests need {browser_missing()}: {INSTALL}", allow_module_level=True)

pytestmark = pytest.mark.browser
PROMPT = "The <b>capital</b> of France is"


@pytest.fixture(scope="module")
def contrast(tmp_path_factory):
    out = tmp_path_factory.mktemp("target") / "contrast.json"
    g = attribution_graph(load_engine("default"), PROMPT, GraphSettings(max_nodes=60, target="' the' - ' a'",
                                                                      aside_first=True))
    data = write_graph(g, out, model="default")
    server = Served(out)
    yield server, data
    server.stop()


def _rows(browser):
    return browser.execute_script("""return [...document.querySelectorAll('#contributions-table tbody tr')]
        .map((r) => [Number(r.dataset.position), r.cells[1].textContent, Number(r.cells[2].dataset.value)]);""")


def test_a_contrast_lists_each_tokens_signed_contribution_summing_to_it(browser, contrast):
    served, data = contrast
    made = data["metadata"]["info"]["token_contributions"]
    browser.get(served.url)
    wait_for(browser, "#contributions-table tbody tr", len(data["metadata"]["prompt_tokens"]))
    assert "' the' - ' a'" in css(browser, "#contributions-of")[0].text
    assert "set aside" in css(browser, "#aside-note")[0].text
    rows = _rows(browser)
    assert [abs(v) for _, _, v in rows] == sorted((abs(v) for v in made["values"][0]), reverse=True)
    assert {q: v for q, _, v in rows} == dict(enumerate(made["values"][0]))
    assert [v for q, _, v in rows if q == 0] == [0.0]  # the first position holds nothing
    total = float(css(browser, "#contributions-sum")[0].text)
    assert abs(total - made["target_values"][0]) <= 1e-5 * abs(made["target_values"][0])
    assert css(browser, "#target-panel b") == [] and any("<" in t for _, t, _ in rows)
    header = css(browser, "#contributions-table thead th")[0]  # sort by position: largest first, then smallest
    header.click()
    assert [q for q, _, _ in _rows(browser)] == sorted(range(len(rows)), reverse=True)
    header.click()
    assert [q for q, _, _ in _rows(browser)] == list(range(len(rows)))
    assert [log for log in browser.get_log("browser") if log["level"] == "SEVERE"] == []


def test_a_graph_of_the_top_logits_gets_a_button_per_logit(browser, graph_served, graph):
    browser.get(graph_served.url)
    wait_for(browser, "#contributions-table tbody tr")
    logits = [n for n in graph["nodes"] if n["feature_type"] == "logit"]
    picks = css(browser, ".contribution-pick")
    assert len(picks) == len(logits) and css(browser, "#aside-note") == []
    picks[1].click()
    made = graph["metadata"]["info"]["token_contributions"]
    second = made["targets"].index(picks[1].get_attribute("data-id"))
    assert {q: v for q, _, v in _rows(browser)} == dict(enumerate(made["values"][second]))


def test_a_contrast_is_named_as_one_in_the_heads_panel(browser, contrast):
    served, _ = contrast
    browser.get(served.url)
    wait_for(browser, "#head-effects-table tbody tr")
    assert css(browser, "#head-effects-label")[0].text.startswith('logit " the" − " a"')
