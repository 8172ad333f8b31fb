"""A head's attention page explains the score by its parts, in a real headless Chromium: each component's sum on
the query side and on the key side, then the largest pairs, then the contrast of the picked key against another (a
select; default the most attended other key); every table's rows and its remainder row add up to the score (or the
difference) exactly; a file written before the sums were recorded shows the same tables.

The graph is the default model's (conftest: ``graph_file``); the attention file is real, written by ``detjac
attention`` on the same model and prompt. Needs chromium, chromedriver and selenium (skipped otherwise, saying so).
"""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner
from test_view_browser import css, wait_for
from view_helpers import GRAPH_PROMPT

from detjac.cli.main import main
from detjac.qk_sums import contrast_sums
from detjac.view.headless import INSTALL, Served, browser_missing

if browser_missing():  # one line in the summary for the whole module, never a silent pass
    pytest.skip(f"browser tests need {browser_missing()}: {INSTALL}", allow_module_level=True)

pytestmark = pytest.mark.browser
SHOWN = 12  # rows of each sums table on the page


@pytest.fixture(scope="module")
def parts(graph, tmp_path_factory):
    """The graph with head 3.1's attention file beside it, and head 2.0's with its sums removed (as written before
    they were recorded), served."""
    folder = tmp_path_factory.mktemp("parts")
    (folder / "copper.json").write_text(json.dumps(graph))
    files = {}
    for layer, head in ((3, 1), (2, 0)):
        out = folder / f"copper.qk.L{layer}.H{head}.json"
        result = CliRunner().invoke(main, ["attention", "-p", GRAPH_PROMPT, "--layer", str(layer), "--head",
                                           str(head), "--out", str(out)])
        assert result.exit_code == 0, result.output
        files[layer, head] = json.loads(out.read_text())
    old = json.loads(json.dumps(files[2, 0]))
    for key in old["keys"]:
        del key["query_sums"], key["key_sums"]
    (folder / "copper.qk.L2.H0.json").write_text(json.dumps(old))
    server = Served(folder / "copper.json")
    yield {"files": files, "url": server.url}
    server.stop()


def rows_of(driver, table):
    """A sums table as shown: [(component or the remainder's text, full-precision value), ...]."""
    out = []
    for row in css(driver, f"#{table} tbody tr"):
        name = row.get_attribute("data-component") or row.find_element("css selector", "td").text
        out.append((name, float(row.find_element("css selector", ".sum").get_attribute("data-value"))))
    return out


def expected(pairs):
    shown, rest = pairs[:SHOWN], pairs[SHOWN:]
    return [(c, pytest.approx(v, abs=1e-15)) for c, v in shown] + \
        ([(f"the other {len(rest)} components", pytest.approx(math.fsum(v for _, v in rest), abs=1e-12))]
         if rest else [])


def sums(key, side):
    return [(s["component"], s["value"]) for s in key[side]]


def test_the_attended_key_is_explained_by_each_side_and_contrasted_with_the_next(browser, parts):
    qk = parts["files"][3, 1]
    browser.get(parts["url"] + "#/attention/3.1.7")
    wait_for(browser, "#query-sums tbody tr")
    first, second, third = sorted(qk["keys"], key=lambda k: (-k["probability"], k["position"]))[:3]
    scale = max(1.0, abs(first["score"]))
    for table, side in (("query-sums", "query_sums"), ("key-sums", "key_sums")):
        shown = rows_of(browser, table)
        assert shown == expected(sums(first, side))
        assert len(shown) == SHOWN + 1  # the default model has more components than rows: a remainder row
        assert abs(math.fsum(v for _, v in shown) - first["score"]) < 1e-12 * scale
    assert css(browser, "#contrast-other")[0].get_attribute("value") == str(second["position"])
    for other in (second, third):
        if other is third:
            css(browser, f'#contrast-other option[value="{third["position"]}"]')[0].click()
            wait_for(browser, f'#contrast-other option[value="{third["position"]}"]:checked')
        difference = first["score"] - other["score"]
        assert css(browser, "#contrast-title")[0].text.startswith(
            f"Contrast: key {first['position']} {json.dumps(qk['tokens'][first['position']])} against key")
        for table, side in (("contrast-query", "query_sums"), ("contrast-key", "key_sums")):
            shown = rows_of(browser, table)
            assert shown == expected(contrast_sums(sums(first, side), sums(other, side)))
            assert abs(math.fsum(v for _, v in shown) - difference) < 1e-12 * scale
    css(browser, f'#pattern tr[data-position="{second["position"]}"]')[0].click()  # another key: its own parts
    wait_for(browser, f'#pattern tr.picked[data-position="{second["position"]}"]')
    assert rows_of(browser, "query-sums") == expected(sums(second, "query_sums"))
    assert css(browser, "#contrast-other")[0].get_attribute("value") == str(first["position"])
    assert [log for log in browser.get_log("browser") if log["level"] == "SEVERE"] == []


def test_a_file_written_before_the_sums_were_recorded_shows_the_same_tables(browser, parts):
    qk = parts["files"][2, 0]
    browser.get(parts["url"] + "#/attention/2.0.7")
    wait_for(browser, "#key-sums tbody tr")
    first = max(qk["keys"], key=lambda k: k["probability"])
    for table, side in (("query-sums", "query_sums"), ("key-sums", "key_sums")):
        got = rows_of(browser, table)
        assert got == expected(sums(first, side))  # the sums as this version records them
        assert abs(math.fsum(v for _, v in got) - first["score"]) < 1e-12 * max(1.0, abs(first["score"]))
