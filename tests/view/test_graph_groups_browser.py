"""Groups (supernodes) on the graph page in a real headless Chromium: a group is drawn collapsed, one node with its
summed links, a click expands it into its members and the group list collapses it back; its hostile name stays text.

Needs chromium, chromedriver and selenium (skipped otherwise, saying so; see :mod:`detjac.view.headless`).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from test_view_browser import css, wait_for

from detjac.view.graph_page import graph_payload
from detjac.view.headless import INSTALL, Served, browser_missing

if browser_missing():
    pytest.skip(f"browser tests need {browser_missing()}: {INSTALL}", allow_module_level=True)

pytestmark = pytest.mark.browser
HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def grouped_file(graph, tmp_path_factory):
    """The default graph with two neurons of its fullest layer as one group named :data:`HOSTILE`."""
    neurons = [n for n in graph["nodes"] if n["feature_type"] == "mlp neuron"]
    layer = Counter(n["layer"] for n in neurons).most_common(1)[0][0]
    members = [n["node_id"] for n in neurons if n["layer"] == layer][:2]
    path = tmp_path_factory.mktemp("grouped") / "grouped.json"
    path.write_text(json.dumps({**graph, "qParams": {**graph["qParams"], "supernodes": [[HOSTILE, *members]]}}))
    return path


def test_a_group_is_drawn_collapsed_expands_on_click_and_keeps_its_name_as_text(browser, grouped_file):
    from selenium.common.exceptions import NoAlertPresentException

    page = graph_payload(json.loads(grouped_file.read_text()))
    group = page["groups"]["nodes"][0]
    members = group["members"]
    server = Served(grouped_file)
    try:
        browser.get(server.url)
        wait_for(browser, "#graph-svg .node-group")
        assert [g.get_attribute("data-id") for g in css(browser, "#graph-svg .node-group")] == ["G_0"]
        drawn = {g.get_attribute("data-id") for g in css(browser, "#graph-svg .node")}
        assert not drawn & set(members)  # collapsed: its members are not drawn
        title = css(browser, '#graph-svg .node-group title')[0].get_attribute("textContent")
        assert title == f"{HOSTILE} (2 neurons) (G_0)"
        label = css(browser, "#graph-svg .group-label")[0].get_attribute("textContent")
        assert label == f"{HOSTILE[:21]}… ×2"
        weights = {(x["source"], x["target"]): x["weight"] for x in page["groups"]["links"]}
        lines = css(browser, '#graph-svg line.link[data-source="G_0"], #graph-svg line.link[data-target="G_0"]')
        assert lines and len(lines) == sum(1 for s, t in weights if "G_0" in (s, t) and
                                           {s, t} - {"G_0"} <= drawn)
        for line in lines:  # each the sum computed by detjac view, as it sent it
            key = (line.get_attribute("data-source"), line.get_attribute("data-target"))
            assert float(line.get_attribute("data-weight")) == weights[key]
        css(browser, "#graph-svg .node-group rect")[0].click()  # its box, as a reader clicks it
        wait_for(browser, f'#graph-svg .node[data-id="{members[0]}"]')
        drawn = {g.get_attribute("data-id") for g in css(browser, "#graph-svg .node")}
        assert set(members) <= drawn and "G_0" not in drawn
        button = css(browser, "#group-panel .group-toggle")[0]
        assert button.get_attribute("aria-pressed") == "true" and HOSTILE in button.text
        button.click()
        wait_for(browser, "#graph-svg .node-group")
        drawn = {g.get_attribute("data-id") for g in css(browser, "#graph-svg .node")}
        assert "G_0" in drawn and not drawn & set(members)
        assert css(browser, "img") == [] and browser.title == "detjac view"
        with pytest.raises(NoAlertPresentException):
            browser.switch_to.alert.text  # noqa: B018 - raises when no alert() ran
    finally:
        server.stop()


def test_when_no_group_is_valid_the_page_still_says_why_each_is_not_drawn(browser, graph, tmp_path):
    neurons = [n for n in graph["nodes"] if n["feature_type"] == "mlp neuron"]
    token = next(n["node_id"] for n in graph["nodes"] if n["feature_type"] == "embedding")
    path = tmp_path / "ungrouped.json"
    supernodes = [[HOSTILE, neurons[0]["node_id"], token]]  # a token in it: no exact group
    path.write_text(json.dumps({**graph, "qParams": {**graph["qParams"], "supernodes": supernodes}}))
    server = Served(path)
    try:
        browser.get(server.url)
        wait_for(browser, "#group-note")
        note = css(browser, "#group-note")[0].text
        assert f"group 0 ({HOSTILE}): {token!r} is no neuron of this graph" in note
        assert css(browser, "#graph-svg .node-group") == [] and css(browser, "#group-panel .group-toggle") == []
        assert css(browser, "img") == []
    finally:
        server.stop()
