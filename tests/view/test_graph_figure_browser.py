"""A figure of a graph in a real headless Chromium: nodes pinned by shift-click and by the P key, a supernode made by
hand, the subgraph of the pinned nodes, the state saved as a new graph JSON (qParams; the file shown unchanged) that
restores it when opened, a labelled SVG of the subgraph whose labels are text (a model-made label with markup stays
text), and the heads table sorted by any column; a neuron's page opened from a node leads with the node's sign.

Needs chromium, chromedriver and selenium (skipped otherwise, saying so; see :mod:`detjac.view.headless`).
"""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from collections import Counter

import pytest
from test_view_browser import css, wait_for
from view_helpers import INJECTED, with_head_loadings

from detjac.analysis import neuron_page
from detjac.store import open_neuron_index
from detjac.view.headless import INSTALL, Served, browser_missing

if browser_missing():
    pytest.skip(f"browser tests need {browser_missing()}: {INSTALL}", allow_module_level=True)

pytestmark = pytest.mark.browser
LABEL = f"<b>bold</b> {INJECTED}"  # a model-made label (clerp) with markup in it
GROUP = "<i>grouped</i> & co"
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def figure_case(graph, tmp_path_factory):
    """The default graph with :data:`LABEL` as one neuron's label, its file's bytes, two neurons of one layer (to
    group) and the labelled neuron (of another layer), and a folder the browser downloads into."""
    data = json.loads(json.dumps(graph))
    neurons = [n for n in data["nodes"] if n["feature_type"] == "mlp neuron"]
    layer = Counter(n["layer"] for n in neurons).most_common(1)[0][0]
    pair = [n["node_id"] for n in neurons if n["layer"] == layer][:2]
    linked = {x["source"] for x in data["links"] if x["target"] in pair} | \
        {x["target"] for x in data["links"] if x["source"] in pair}
    other = next(n for n in neurons if n["layer"] != layer and n["node_id"] in linked)
    other["clerp"] = LABEL
    folder = tmp_path_factory.mktemp("figure")
    path = folder / "figure-case.json"
    path.write_text(json.dumps(data))
    (folder / "downloads").mkdir()
    return {"path": path, "bytes": path.read_bytes(), "pair": pair, "labelled": other["node_id"],
            "downloads": folder / "downloads", "graph": data, "stem": data["metadata"]["slug"]}


def downloaded(folder, name, timeout=20.0):
    """The file ``name`` once the browser has written it into ``folder`` whole."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        path = folder / name
        if path.exists() and not list(folder.glob("*.crdownload")) and path.stat().st_size:
            return path
        time.sleep(0.1)
    raise AssertionError(f"no {name} in {folder}: {sorted(p.name for p in folder.iterdir())}")


def drawn(browser):
    return {g.get_attribute("data-id") for g in css(browser, "#graph-svg .node")}


def shift_click(browser, node_id):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    mark = css(browser, f'#graph-svg .node[data-id="{node_id}"] circle')[0]
    ActionChains(browser).key_down(Keys.SHIFT).click(mark).key_up(Keys.SHIFT).perform()


def pinned(browser):
    return [li.get_attribute("data-id") for li in css(browser, "#pinned-list li")]


def test_pins_a_hand_made_group_the_saved_json_and_the_svg(browser, figure_case):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.action_chains import ActionChains

    case, (a, b), c = figure_case, figure_case["pair"], figure_case["labelled"]
    browser.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow",
                                                             "downloadPath": str(case["downloads"])})
    server = Served(case["path"])
    try:
        browser.get(server.url)
        wait_for(browser, "#graph-svg .node-neuron")
        shift_click(browser, a)
        shift_click(browser, b)
        css(browser, f'#graph-svg .node[data-id="{c}"] circle')[0].click()  # selected, then P pins it
        ActionChains(browser).send_keys("p").perform()
        assert pinned(browser) == [a, b, c]
        assert {g.get_attribute("data-id") for g in css(browser, "#graph-svg .node.pinned")} == {a, b, c}
        assert css(browser, f'#pinned-list li[data-id="{c}"] .text')[0].text == LABEL
        shift_click(browser, a)  # unpinned, and again
        assert pinned(browser) == [b, c]
        shift_click(browser, a)
        # a group of a neuron and a token is refused, by name, and nothing changes
        for box in css(browser, "#pinned-list .pin-pick"):
            if box.get_attribute("data-id") in (a, c):
                box.click()
        css(browser, "#supernode-make")[0].click()
        assert css(browser, "#figure-note")[0].text.startswith("Expected neurons of one layer")
        assert not css(browser, "#graph-svg .node-group")
        for box in css(browser, "#pinned-list .pin-pick"):
            if box.get_attribute("data-id") in (b, c):
                box.click()  # ticked: a and b
        css(browser, "#supernode-name")[0].send_keys(GROUP)
        css(browser, "#supernode-make")[0].click()
        wait_for(browser, "#graph-svg .node-group")
        assert [g.get_attribute("data-id") for g in css(browser, "#graph-svg .node-group")] == ["G_0"]
        assert not drawn(browser) & {a, b} and pinned(browser) == [b, c, a]
        assert css(browser, '#graph-svg .node-group title')[0].get_attribute("textContent") == \
            f"{GROUP} (2 neurons) (G_0)"
        css(browser, "#subgraph-only")[0].click()
        assert drawn(browser) == {"G_0", c}
        lines = css(browser, "#graph-svg line.link")
        links = {(x.get_attribute("data-source"), x.get_attribute("data-target")) for x in lines}
        into = [x for x in case["graph"]["links"] if {x["source"], x["target"]} == {a, c} or
                {x["source"], x["target"]} == {b, c}]
        assert into and links == ({("G_0", c) if x["source"] in (a, b) else (c, "G_0") for x in into})
        for line in lines:  # each the sum of its members' links
            s = line.get_attribute("data-source")
            parts = [x["weight"] for x in into if (x["source"] == c) == (s == c)]
            assert float(line.get_attribute("data-weight")) == pytest.approx(sum(parts), rel=1e-14, abs=1e-300)

        css(browser, "#figure-save")[0].click()
        saved = json.loads(downloaded(case["downloads"], f"{case['stem']}.figure.json").read_text())
        assert saved["qParams"]["pinnedIds"] == [b, c, a]
        assert saved["qParams"]["supernodes"] == [[GROUP, b, a]]  # its members in the pinned list's order
        assert [n["node_id"] for n in saved["nodes"]] == [n["node_id"] for n in case["graph"]["nodes"]]
        assert [(x["source"], x["target"], x["weight"]) for x in saved["links"]] == \
            [(x["source"], x["target"], x["weight"]) for x in case["graph"]["links"]]
        assert next(n for n in saved["nodes"] if n["node_id"] == c)["clerp"] == LABEL
        assert case["path"].read_bytes() == case["bytes"]  # the file shown is never written

        css(browser, "#figure-svg")[0].click()
        root = ET.parse(downloaded(case["downloads"], f"{case['stem']}.figure.svg")).getroot()
        assert root.tag == f"{SVG}svg"
        tags = {e.tag for e in root.iter()}
        assert tags <= {f"{SVG}{t}" for t in ("svg", "rect", "text", "line", "title", "g", "circle")}
        labels = {g.get("data-id"): g.find(f"{SVG}text").text for g in root.iter(f"{SVG}g")}
        assert labels == {c: LABEL, "G_0": f"{GROUP} (2 neurons)"}  # the markup as text, never elements
        svg_links = root.findall(f"{SVG}line")
        assert len(svg_links) == len(lines)
        for line in svg_links:
            w = float(line.get("data-weight"))
            assert line.get("stroke") == ("#2a62b8" if w >= 0 else "#d0543e") and float(line.get("stroke-width")) > 0
        assert css(browser, "img") == [] and css(browser, "b") == [] and browser.title == "detjac view"
        with pytest.raises(NoAlertPresentException):
            browser.switch_to.alert.text  # noqa: B018 - raises when no alert() ran
    finally:
        server.stop()

    again = Served(case["downloads"] / f"{case['stem']}.figure.json")  # opened again: the figure restored
    try:
        browser.get(again.url)
        wait_for(browser, "#graph-svg .node-group")
        assert pinned(browser) == [b, c, a]
        assert [g.get_attribute("data-id") for g in css(browser, "#graph-svg .node-group")] == ["G_0"]
        assert {g.get_attribute("data-id") for g in css(browser, "#graph-svg .node.pinned")} == {"G_0", c}
    finally:
        again.stop()


def test_the_heads_table_sorts_by_any_column(browser, graph, tmp_path):
    path = tmp_path / "loaded.json"
    path.write_text(json.dumps(with_head_loadings(graph, 4, top=300)))
    server = Served(path)
    try:
        browser.get(server.url)
        wait_for(browser, "#heads-table tbody tr")

        def column(i):
            return [float(td.get_attribute("data-value")) for td in
                    css(browser, f"#heads-table tbody tr td:nth-child({i})")]

        rows = len(css(browser, "#heads-table tbody tr"))
        header = css(browser, "#heads-table th")
        header[4].click()  # direct: largest first
        assert column(5) == sorted(column(5), reverse=True) and len(column(5)) == rows
        assert header[4].get_attribute("aria-sort") == "descending"
        header[4].click()
        assert column(5) == sorted(column(5)) and header[4].get_attribute("aria-sort") == "ascending"
        header[2].click()
        assert column(3) == sorted(column(3), reverse=True) and header[4].get_attribute("aria-sort") is None
        header[0].click()
        header[0].click()  # the panel's own rank again
        assert column(1) == list(range(1, rows + 1))
        heads = [tr.get_attribute("data-head") for tr in css(browser, "#heads-table tbody tr")]
        header[1].click()
        assert sorted(heads, key=lambda x: [-int(v) for v in x.split(".")]) == \
            [tr.get_attribute("data-head") for tr in css(browser, "#heads-table tbody tr")]
    finally:
        server.stop()


def test_a_neurons_page_leads_with_the_side_its_node_fires_on(browser, graph_file, neuron_index):
    index = open_neuron_index(neuron_index)
    nodes = [n for n in json.loads(graph_file.read_text())["nodes"] if n["feature_type"] == "mlp neuron"]
    server = Served(graph_file, "--neurons", str(neuron_index))
    try:
        browser.get(server.url)
        wait_for(browser, "#neuron-search")
        for node in (next(n for n in nodes if n["activation"] < 0), next(n for n in nodes if n["activation"] > 0)):
            layer, neuron, _ = (int(x) for x in node["node_id"].split("_"))
            page = neuron_page(index, layer, neuron)
            css(browser, f'#graph-svg .node[data-id="{node["node_id"]}"] circle')[0].click()
            wait_for(browser, f'#neuron-page[data-shown="{layer}.{neuron}"]')
            negative = node["activation"] < 0
            clerp = css(browser, "#neuron-clerp")[0]
            assert clerp.text == (page["clerp_negative"] if negative else page["clerp"])
            assert clerp.text.startswith("− ") == negative
            sides = [x.text for x in css(browser, ".neuron-contexts h4")]
            assert sides == (["top negative contexts", "top positive contexts"] if negative
                             else ["top positive contexts", "top negative contexts"])
            assert [o.get_attribute("id") for o in css(browser, ".neuron-writes ol")] == \
                (["neuron-lowers", "neuron-raises"] if negative else ["neuron-raises", "neuron-lowers"])
    finally:
        server.stop()


def test_a_static_export_pins_and_saves_from_disk(browser, graph_file, graph, tmp_path):
    from click.testing import CliRunner

    from detjac.cli.main import main

    out, downloads = tmp_path / "pages", tmp_path / "downloads"
    downloads.mkdir()
    result = CliRunner().invoke(main, ["view", str(graph_file), "--export", str(out)])
    assert result.exit_code == 0, result.output
    browser.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    browser.get((out / "index.html").as_uri())  # no server: file:// only
    wait_for(browser, "#graph-svg .node-neuron")
    first = css(browser, "#graph-svg .node-neuron")[0].get_attribute("data-id")
    shift_click(browser, first)
    assert pinned(browser) == [first]
    css(browser, "#figure-save")[0].click()
    saved = json.loads(downloaded(downloads, f"{graph['metadata']['slug']}.figure.json").read_text())
    assert saved["qParams"]["pinnedIds"] == [first] and len(saved["links"]) == len(graph["links"])
