"""Attention heads on the graph page, in a real headless Chromium: a clicked link's head loadings, the heads panel and
its links to attention pages (or the commands that make them), a head's attention page (its pattern and largest QK
terms, each component a click away from what it names), markup in token texts kept as text, and the static export.

The graph is the default model's (conftest: ``graph_file``) with synthetic head loadings on its 300 strongest links
(``with_head_loadings``: each layer sums to the link's weight; this tests the viewer, not the engine); the attention
files are real, written by ``detjac attention`` on the same model and prompt. Needs chromium, chromedriver and
selenium (skipped otherwise, saying so).
"""

from __future__ import annotations

import json
import shlex

import pytest
from click.testing import CliRunner
from test_view_browser import css, wait_for
from view_helpers import GRAPH_PROMPT, INJECTED, crossed_layers, with_head_loadings

from detjac.cli.main import main
from detjac.view import GraphFile
from detjac.view.headless import INSTALL, Served, browser_missing

if browser_missing():  # one line in the summary for the whole module, never a silent pass
    pytest.skip(f"browser tests need {browser_missing()}: {INSTALL}", allow_module_level=True)

pytestmark = pytest.mark.browser
N_HEADS = 4  # the default model's


def attention(out, layer, head):
    result = CliRunner().invoke(main, ["attention", "-p", GRAPH_PROMPT, "--layer", str(layer), "--head", str(head),
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def heads(graph, tmp_path_factory):
    """A folder with the loaded graph (copper.json), head 3.1's file beside it by name and, elsewhere, the file of
    a layer-2 head among 3.1's largest terms (given with --attention)."""
    folder = tmp_path_factory.mktemp("heads")
    loaded = with_head_loadings(graph, N_HEADS, top=300)
    (folder / "copper.json").write_text(json.dumps(loaded))
    top = attention(folder / "copper.qk.L3.H1.json", 3, 1)
    best = max(top["keys"], key=lambda k: k["probability"])
    name = next(c for t in best["terms"][:16] for c in (t["query"], t["key"]) if c.startswith("A2."))
    (folder / "extra").mkdir()
    second = attention(folder / "extra" / "qk.json", 2, int(name.split(".")[1]))
    return {"folder": folder, "graph": loaded, "top": top, "second": second, "extra": folder / "extra" / "qk.json"}


@pytest.fixture(scope="module")
def heads_served(heads):
    server = Served(heads["folder"] / "copper.json", "--attention", str(heads["extra"]))
    yield server
    server.stop()


def click(driver, element):
    """A click the page receives as from a mouse (a link's line is thin: a real pointer may land on a node)."""
    driver.execute_script("arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", element)


def test_a_clicked_link_shows_its_head_loadings(browser, heads_served, heads):
    graph = heads["graph"]
    browser.get(heads_served.url)
    wait_for(browser, "#graph-svg .node", len(graph["nodes"]))
    index, link = max(enumerate(graph["links"]), key=lambda x: abs(x[1]["weight"]))
    click(browser, css(browser, f'#graph-svg .link[data-index="{index}"]')[0])
    rows = wait_for(browser, "#link-loadings tbody tr")
    assert [int(r.get_attribute("data-layer")) for r in rows] == list(crossed_layers(graph, link))
    for row in rows:
        per = link["head_loadings"][row.get_attribute("data-layer")]
        shown = [(e.get_attribute("data-head"), float(e.get_attribute("data-loading")))
                 for e in row.find_elements("css selector", ".loading")]
        largest = sorted(((k, w) for k, w in per.items() if k != "skip"), key=lambda x: -abs(x[1]))[:4]
        assert shown == [(f"{row.get_attribute('data-layer')}.{k}", w) for k, w in largest]
        assert float(row.find_element("css selector", ".skip").get_attribute("data-skip")) == per["skip"]
    assert css(browser, "#graph-svg .link.picked")[0].get_attribute("data-index") == str(index)
    unloaded = next(i for i, x in enumerate(graph["links"]) if "head_loadings" not in x)
    click(browser, css(browser, f'#graph-svg .link[data-index="{unloaded}"]')[0])
    assert "detjac graph ... --heads N" in wait_for(browser, "#link-no-loadings")[0].text
    assert css(browser, "#link-loadings") == []
    target = link["target"]  # the same loadings from the node's edge table, with a real click
    css(browser, f'#graph-svg .node[data-id="{target}"]')[0].click()
    row = wait_for(browser, f'#incoming tbody tr[data-id="{link["source"]}"] .loadings-button')[0]
    row.click()
    assert len(wait_for(browser, "#link-loadings tbody tr")) == len(rows)
    assert [log for log in browser.get_log("browser") if log["level"] == "SEVERE"] == []


def test_the_heads_panel_ranks_heads_and_links_their_attention_pages(browser, heads_served, heads):
    expected = GraphFile(heads["folder"] / "copper.json", [heads["extra"]]).data("graph")["metadata"]["heads"]
    browser.get(heads_served.url)
    rows = wait_for(browser, "#heads-table tbody tr", len(expected["rows"]))
    assert [r.get_attribute("data-head") for r in rows] == [f"{x['layer']}.{x['head']}" for x in expected["rows"]]
    assert css(browser, "#heads-coverage")[0].text.startswith(f"{expected['loaded']} of {len(heads['graph']['links'])}")
    second = f"2.{heads['second']['head']}"
    for row, x in zip(rows, expected["rows"], strict=True):
        name = f"{x['layer']}.{x['head']}"
        links = row.find_elements("css selector", "a.attention-link")
        if name in ("3.1", second):
            assert links and links[0].get_attribute("href").endswith(f"#/attention/{name}.7")
        else:
            assert not links and row.find_element("css selector", "code.command").text == x["command"]
            assert f"--layer {x['layer']} --head {x['head']} --out copper.qk.L{x['layer']}.H{x['head']}.json" in \
                x["command"]
    next(r for r in rows if r.get_attribute("data-head") == "3.1").find_element("css selector", "a").click()
    wait_for(browser, "#pattern tbody tr", len(heads["top"]["keys"]))
    assert css(browser, "h1")[0].text == 'Head 3.1 at query 7 " A"'


def shown_terms(driver):
    return [(r.get_attribute("data-query"), r.get_attribute("data-key"),
             float(r.find_element("css selector", ".term").text)) for r in css(driver, "#terms tbody tr[data-query]")]


def test_an_attention_page_shows_the_pattern_and_the_largest_terms(browser, heads_served, heads):
    qk, graph = heads["top"], heads["graph"]
    browser.get(heads_served.url + "#/attention/3.1.7")
    rows = wait_for(browser, "#pattern tbody tr", len(qk["keys"]))
    assert [r.text.split()[1] for r in rows] == [json.dumps(qk["tokens"][k["position"]]).split()[0]
                                                 for k in qk["keys"]]
    assert [float(r.find_element("css selector", ".prob").text) for r in rows] == \
        [round(k["probability"], 3) for k in qk["keys"]]
    best = max(qk["keys"], key=lambda k: k["probability"])
    assert css(browser, "#pattern tr.picked")[0].get_attribute("data-position") == str(best["position"])

    def largest(key):
        return [(t["query"], t["key"], pytest.approx(t["value"], rel=1e-3)) for t in
                sorted(key["terms"], key=lambda t: -abs(t["value"]))[:16]]

    assert shown_terms(browser) == largest(best)
    other = qk["keys"][1]
    rows[1].click()
    assert css(browser, "#pattern tr.picked")[0].get_attribute("data-position") == str(other["position"])
    assert shown_terms(browser) == largest(other)
    rows[best["position"]].click()
    second = f"A2.{heads['second']['head']}"  # a head with a page: its component opens it
    css(browser, f'#terms a.component[data-component="{second}"]')[0].click()
    wait_for(browser, "#pattern tbody tr", len(heads["second"]["keys"]))
    assert css(browser, "h1")[0].text == f'Head {second[1:]} at query 7 " A"'
    browser.back()
    wait_for(browser, "#terms tbody tr")
    pageless = next(e for e in css(browser, "#terms button.component") if e.get_attribute("data-component")
                    .startswith("A"))  # a head without a page: its command
    name = pageless.get_attribute("data-component")
    pageless.click()
    layer, head = name[1:].split(".")
    assert css(browser, "#component-command")[0].text == f"detjac attention default -p 'Copper, n. A' " \
        f"--layer {layer} --head {head} --out copper.qk.L{layer}.H{head}.json"
    for side, position in (("key", best["position"]), ("query", 7)):  # an MLP: its layer's neurons there, ringed
        browser.get(heads_served.url + "#/attention/3.1.7")
        css(browser, f'#terms a.component[data-component="M0"][data-side="{side}"]')[0].click()
        wait_for(browser, "#graph-svg .node", len(graph["nodes"]))
        at = {n["node_id"] for n in graph["nodes"] if n["feature_type"] == "mlp neuron" and n["layer"] == "0"
              and n["ctx_idx"] == position}
        assert {e.get_attribute("data-id") for e in css(browser, "#graph-svg .node.highlit")} == at
        assert css(browser, "#highlight-note")[0].text.startswith(
            f"Highlighted: the {len(at)} neurons of layer 0 at position {position}" if at else
            f"No neuron of layer 0 at position {position}")
        assert side == "key" or at  # the graph keeps layer-0 neurons at the last position: both cases seen
    browser.get(heads_served.url + "#/attention/3.1.7")
    wait_for(browser, "#terms tbody tr")
    href = browser.execute_script("return AttentionPage.target(arguments[0], 'E', 3).href",
                                  {"tokens": qk["tokens"], "token_ids": qk["token_ids"]})
    token = f"E_{qk['token_ids'][3]}_3"
    assert href == f"#/graph/node/{token}"
    browser.get(heads_served.url + href)
    wait_for(browser, "#graph-svg .node.selected")
    assert css(browser, "#graph-svg .node.selected")[0].get_attribute("data-id") == token
    assert [log for log in browser.get_log("browser") if log["level"] == "SEVERE"] == []


def test_markup_in_token_texts_stays_text_on_the_attention_page(browser, heads, tmp_path):
    from selenium.common.exceptions import NoAlertPresentException

    graph, qk = json.loads(json.dumps(heads["graph"])), json.loads(json.dumps(heads["top"]))
    graph["metadata"]["prompt_tokens"][3] = qk["tokens"][3] = INJECTED  # the same prompt on both sides
    (tmp_path / "bad.json").write_text(json.dumps(graph))
    (tmp_path / "bad.qk.L3.H1.json").write_text(json.dumps(qk))
    server = Served(tmp_path / "bad.json")
    try:
        browser.get(server.url + "#/attention/3.1.7")
        rows = wait_for(browser, "#pattern tbody tr", len(qk["keys"]))
        assert rows[3].find_element("css selector", "td.text").text == json.dumps(INJECTED)
        browser.get(server.url)
        wait_for(browser, "#heads-table tbody tr")
        command = shlex.split(css(browser, "#heads-table code.command")[0].text)  # the prompt, quoted for a shell
        assert command[4] == "".join(graph["metadata"]["prompt_tokens"][1:]) and INJECTED in command[4]
        assert css(browser, "img") == [] and browser.title == "detjac view"
        with pytest.raises(NoAlertPresentException):
            browser.switch_to.alert.text  # noqa: B018 - raises when no alert() ran
    finally:
        server.stop()


def test_the_export_holds_the_attention_pages(browser, heads, tmp_path):
    result = CliRunner().invoke(main, ["view", str(heads["folder"] / "copper.json"), "--attention",
                                       str(heads["extra"]), "--export", str(tmp_path / "pages")])
    assert result.exit_code == 0, result.output
    second = f"2.{heads['second']['head']}.7"
    assert {p.name for p in (tmp_path / "pages" / "data").iterdir()} == \
        {"corpus.js", "graph.js", "attention.3.1.7.js", f"attention.{second}.js"}
    browser.get((tmp_path / "pages" / "index.html").as_uri())
    rows = wait_for(browser, "#heads-table tbody tr")
    next(r for r in rows if r.get_attribute("data-head") == "3.1").find_element("css selector", "a").click()
    wait_for(browser, "#pattern tbody tr", len(heads["top"]["keys"]))
    css(browser, f'#terms a.component[data-component="A{second[:-2]}"]')[0].click()
    wait_for(browser, "#pattern tbody tr", len(heads["second"]["keys"]))
    assert browser.current_url.endswith(f"#/attention/{second}")


def test_the_heads_panel_lists_every_head_s_direct_effect_and_sorts_by_it(browser, graph_served, graph):
    from selenium.webdriver.support.ui import Select

    effects = graph["metadata"]["info"]["head_effects"]
    values = effects["values"]  # K x layers x heads
    every = [(layer, head) for layer in range(len(values[0])) for head in range(N_HEADS)]

    def shown():
        rows = css(browser, "#head-effects-table tbody tr")
        return [(r.get_attribute("data-head"), float(r.get_attribute("data-effect"))) for r in rows]

    def by_size(k):
        return [(f"{layer}.{head}", values[k][layer][head]) for layer, head in
                sorted(every, key=lambda lh: (-abs(values[k][lh[0]][lh[1]]), lh))]

    browser.get(graph_served.url)
    wait_for(browser, "#head-effects-table tbody tr", len(every))
    assert css(browser, "#heads-none")  # no link loaded: every head is still listed, by its direct effect
    assert shown() == by_size(0)
    assert css(browser, "#head-effects-table")[0].get_attribute("data-target") == effects["targets"][0]
    assert css(browser, "#head-effects-meaning")[0].text.startswith("Direct effect: the head's output")
    header = css(browser, "#head-effects-table th")[2]
    header.click()  # a numeric column: largest first
    assert shown() == sorted(by_size(0), key=lambda x: -x[1]) and header.get_attribute("aria-sort") == "descending"
    header.click()
    assert shown() == sorted(by_size(0), key=lambda x: x[1])
    assert len(effects["targets"]) > 1  # the default model's graph has several logits: a selector among them
    Select(css(browser, "#head-effects-select")[0]).select_by_index(1)
    assert css(browser, "#head-effects-table")[0].get_attribute("data-target") == effects["targets"][1]
    assert shown() == by_size(1)
    assert [log for log in browser.get_log("browser") if log["level"] == "SEVERE"] == []
