"""Neuron pages in a real headless Chromium (``detjac view graph.json --neurons index``): a click on a graph's neuron
and the search box show its page, and the corpus's hostile text stays text; in a static export opened from disk
(``--export``), a click shows the page and the search box offers the graph's neurons only.

Needs chromium, chromedriver and selenium (skipped otherwise, saying so; see ``detjac.view.headless``).
"""

from __future__ import annotations

import pytest
from test_view_browser import css, wait_for

from detjac.analysis import neuron_page
from detjac.store import open_neuron_index
from detjac.view.headless import INSTALL, Served, browser_missing

if browser_missing():
    pytest.skip(f"browser tests need {browser_missing()}: {INSTALL}", allow_module_level=True)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def index_path(neuron_index):
    return neuron_index


def test_a_neurons_page_from_a_click_and_from_the_search_box_keeps_text_as_text(browser, graph_file, index_path):
    from selenium.common.exceptions import NoAlertPresentException

    index = open_neuron_index(index_path)
    server = Served(graph_file, "--neurons", str(index_path))
    try:
        browser.get(server.url)
        wait_for(browser, "#graph-svg .node-neuron")
        wait_for(browser, "#neuron-search")
        node = css(browser, "#graph-svg .node-neuron")[0]
        layer, neuron, _ = (int(x) for x in node.get_attribute("data-id").split("_"))
        negative = float(node.get_attribute("data-activation")) < 0  # its label of the side it fires on here
        node.click()
        wait_for(browser, "#neuron-title")
        assert css(browser, "#neuron-title")[0].text == f"neuron {layer}.{neuron}"
        assert css(browser, "#neuron-clerp")[0].text == \
            neuron_page(index, layer, neuron)["clerp_negative" if negative else "clerp"]
        # a neuron whose top context is in the hostile prompt (prompt 0), from the search box
        top = index.arrays["top_prompt"][:, :, 0, 0]
        layer, neuron = (int(v) for v in next(zip(*(top == 0).nonzero(), strict=True)))
        browser.execute_script("document.getElementById('neuron-layer').value = arguments[0];"
                               "document.getElementById('neuron-index').value = arguments[1];", layer, neuron)
        css(browser, "#neuron-search button")[0].click()
        wait_for(browser, "#neuron-positive tbody tr")
        assert css(browser, "#neuron-title")[0].text == f"neuron {layer}.{neuron}"
        page = neuron_page(index, layer, neuron)
        shown = [td.get_attribute("textContent") for td in css(browser, "#neuron-positive td.context")]
        assert shown == ["".join(c["before"]) + c["token"] + "".join(c["after"]) for c in page["contexts"]["positive"]]
        assert any("<img" in s or "<script" in s or "onerror" in s for s in shown)  # the markup, as text
        assert css(browser, "#neuron-positive mark")[0].get_attribute("textContent") == \
            page["contexts"]["positive"][0]["token"]
        assert len(css(browser, "#neuron-histogram rect")) == len(page["histogram"]["counts"])
        assert css(browser, "img") == [] and css(browser, "#neuron-page script") == []
        assert browser.title == "detjac view"
        with pytest.raises(NoAlertPresentException):
            browser.switch_to.alert.text  # noqa: B018 - raises when no alert() ran
    finally:
        server.stop()


def test_the_export_opens_a_clicked_neurons_page_from_disk(browser, graph_file, index_path, tmp_path):
    from click.testing import CliRunner

    from detjac.cli.main import main

    index = open_neuron_index(index_path)
    out = tmp_path / "pages"
    result = CliRunner().invoke(main, ["view", str(graph_file), "--neurons", str(index_path), "--export", str(out)])
    assert result.exit_code == 0, result.output
    browser.get((out / "index.html").as_uri())  # no server: file:// only
    wait_for(browser, "#graph-svg .node-neuron")
    wait_for(browser, "#neuron-pick option")
    ids = [g.get_attribute("data-id") for g in css(browser, "#graph-svg .node-neuron")]
    offered = [o.get_attribute("value") for o in css(browser, "#neuron-pick option")]
    assert offered == [f"{layer}/{neuron}" for layer, neuron in sorted({tuple(int(x) for x in i.split("_")[:2])
                                                                         for i in ids})]
    assert css(browser, "#neuron-only")[0].text == \
        f"this snapshot holds the pages of its graph's {len(offered)} neurons only"
    node = css(browser, "#graph-svg .node-neuron")[-1]
    layer, neuron, _ = (int(x) for x in node.get_attribute("data-id").split("_"))
    node.click()
    wait_for(browser, "#neuron-title")
    assert css(browser, "#neuron-title")[0].text == f"neuron {layer}.{neuron}"
    page = neuron_page(index, layer, neuron)
    shown = [td.get_attribute("textContent") for td in css(browser, "#neuron-positive td.context")]
    assert shown == ["".join(c["before"]) + c["token"] + "".join(c["after"]) for c in page["contexts"]["positive"]]
    assert css(browser, "#neuron-error") == [] and css(browser, "img") == [] and browser.title == "detjac view"
