"""``detjac view`` in a real headless Chromium: the pages draw, clicks lead where they should, the decoded tokens
are ``detjac analyze svd``'s, markup in a prompt stays text, and the static export works from ``file://``.

Needs chromium, chromedriver and selenium (skipped otherwise, saying so; see ``detjac.view.headless``).
"""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner
from view_helpers import MARKUP_WORD, SCRIPT_WORD, copy_store, exported_prompts, script_prompt

from detjac.cli.main import main
from detjac.view.headless import INSTALL, browser_missing

if browser_missing():  # one line in the summary for the whole module, never a silent pass
    pytest.skip(f"browser tests need {browser_missing()}: {INSTALL}", allow_module_level=True)

pytestmark = pytest.mark.browser
WAIT = 30  # seconds for a page to draw (the first pages start dask)


def wait_for(driver, css, count=1):
    """The elements matching ``css`` once there are at least ``count`` of them."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def found(d):
        error = d.find_elements(By.ID, "page-error")
        if error:
            raise AssertionError(f"the page shows an error: {error[0].text}")
        elements = d.find_elements(By.CSS_SELECTOR, css)
        return elements if len(elements) >= count else False

    return WebDriverWait(driver, WAIT).until(found)


def css(driver, selector):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def cli_decoded(store_path, pid, token):
    """``detjac analyze svd STORE --prompt PID --token K`` (its defaults): [(sigma, left, right)] as printed."""
    result = CliRunner().invoke(main, ["analyze", "svd", str(store_path), "--prompt-id", pid, "--token", str(token)])
    assert result.exit_code == 0, result.output
    lefts = re.findall(r"#\d+ sigma (\S+)\s+left -> (.*)", result.output)
    rights = re.findall(r"right \[token (\d+), \d+%(?:; [^\]]*)?\] -> (.*)", result.output)  # a sink flag after ;
    return [(float(s), left, right, int(k)) for (s, left), (k, right) in zip(lefts, rights, strict=True)]


def shown_decoded(driver):
    """The decoded triplets table of the prompt page: [(sigma, left, right, right token)]."""
    rows = []
    for row in css(driver, "#decoded tbody tr"):
        left = " ".join(c.text for c in row.find_elements("css selector", "td.left .chip"))
        right = " ".join(c.text for c in row.find_elements("css selector", "td.right .chip"))
        token = int(re.match(r"\[(\d+)\]", row.find_element("css selector", "td.right-token").text).group(1))
        rows.append((float(row.find_element("css selector", "td.sigma").text), left, right, token))
    return rows


def test_the_corpus_lists_searches_and_sorts_the_prompts(browser, served, layered_store):
    browser.get(served.url)
    rows = wait_for(browser, "#corpus tbody tr", len(layered_store.ids))
    assert sorted(r.get_attribute("data-id") for r in rows) == layered_store.ids
    assert {r.find_element("css selector", ".prompt-link").text for r in rows} == \
        {t.text for t in layered_store.prompts.values()}
    search = css(browser, "#search")[0]
    search.send_keys("cat")
    assert [r.get_attribute("data-id") for r in css(browser, "#corpus tbody tr")] == \
        [pid for pid, t in layered_store.prompts.items() if "cat" in t.text]
    assert css(browser, "#count")[0].text == f"1 of {len(layered_store.ids)} prompts"
    search.clear()
    search.send_keys(" ")  # an input event with an empty query after clear()
    search.clear()
    from selenium.webdriver.support.ui import Select

    Select(css(browser, "#sort")[0]).select_by_value("n_tokens")
    lengths = [int(r.find_elements("css selector", "td")[2].text) for r in css(browser, "#corpus tbody tr")]
    assert lengths == sorted(t.n_tokens for t in layered_store.prompts.values())
    css(browser, "#sort-dir")[0].click()
    lengths = [int(r.find_elements("css selector", "td")[2].text) for r in css(browser, "#corpus tbody tr")]
    assert lengths == sorted((t.n_tokens for t in layered_store.prompts.values()), reverse=True)


def test_a_token_shows_its_spectrum_and_the_tokens_analyze_svd_decodes(browser, served, layered_store, tmp_path):
    pid = layered_store.ids[1]
    truth = layered_store.prompts[pid]
    browser.get(served.url)
    wait_for(browser, f'#corpus tbody tr[data-id="{pid}"]')[0].find_element("css selector", ".prompt-link").click()
    wait_for(browser, '#decoded[data-token="combined"] tbody tr', 5)
    assert css(browser, "#prompt-text")[0].text == truth.text
    assert [b.get_attribute("textContent") for b in css(browser, "#tokens .token .piece")] == \
        [layered_store.model.words[i] for i in truth.token_ids]
    token = 2
    css(browser, f'#tokens .token[data-index="{token}"]')[0].click()
    wait_for(browser, f'#decoded[data-token="{token}"] tbody tr', 5)
    assert browser.current_url.endswith(f"#/prompt/{pid}/operator/{token}")
    picked = [line for line in css(browser, "#spectra-chart polyline")
              if line.get_attribute("data-series").startswith(f"J_{token} ")]
    assert len(picked) == 1 and picked[0].get_attribute("stroke") == "#e08a00"  # the token's spectrum, highlighted
    assert len(css(browser, "#norm-strip rect.cell")) == truth.n_tokens
    cli = cli_decoded(copy_store(layered_store, tmp_path), pid, token)  # computed by the CLI in its own copy
    shown = shown_decoded(browser)
    assert [(left, right, k) for _, left, right, k in shown] == [(left, right, k) for _, left, right, k in cli]
    assert [s for s, *_ in shown] == pytest.approx([s for s, *_ in cli], rel=1e-3)
    css(browser, '#tokens .token[data-index="combined"]')[0].click()
    wait_for(browser, '#decoded[data-token="combined"] tbody tr', 5)


def test_the_layers_tab_draws_and_switches_between_the_stored_kinds(browser, served, layered_store):
    pid = layered_store.ids[0]
    truth = layered_store.prompts[pid]
    browser.get(served.url + f"#/prompt/{pid}")
    tabs = wait_for(browser, "#tabs a[data-tab]", 5)
    assert [t.text for t in tabs] == ["Operators", "Layers: attn", "Layers: layer", "Layers: mlp", "Layers: mlp_local"]
    next(t for t in tabs if t.get_attribute("data-tab") == "layers/layer").click()
    cells = wait_for(browser, "#layers-heatmap rect.cell", 3 * truth.n_tokens)
    assert len(cells) == 3 * truth.n_tokens
    assert [r.get_attribute("data-target") for r in css(browser, "#layer-table tbody tr")] == \
        ["layer.0", "layer.1", "layer.2"]
    assert len(css(browser, "#dims-chart polyline")) == 3 and len(css(browser, "#rank-chart polyline")) == 2
    assert css(browser, "#tracked")[0].text == repr(layered_store.model.words[truth.next_token_id])
    css(browser, '#tabs a[data-tab="layers/mlp_local"]')[0].click()
    wait_for(browser, '#layer-table tbody tr[data-target="mlp_local.0"]')
    assert len(css(browser, "#contribution-heatmap rect.cell")) == 3 * truth.n_tokens


def test_markup_in_a_prompt_and_its_tokens_is_shown_as_text(browser, served, layered_store):
    from selenium.common.exceptions import NoAlertPresentException

    pid = script_prompt(layered_store)
    text = layered_store.prompts[pid].text
    browser.get(served.url)
    link = wait_for(browser, f'#corpus tbody tr[data-id="{pid}"] .prompt-link')[0]
    assert link.text == text and link.find_elements("css selector", "*") == []
    link.click()
    wait_for(browser, "#decoded tbody tr", 5)
    assert css(browser, "#prompt-text")[0].text == text
    tokens = [b.get_attribute("textContent") for b in css(browser, "#tokens .token .piece")]
    assert SCRIPT_WORD in tokens and MARKUP_WORD in tokens
    assert css(browser, "main script, main b, #tokens b") == []  # no element was made from the text
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text  # noqa: B018 - raises when no alert() ran


def test_the_export_opens_from_disk_and_shows_the_same(browser, served, exported, layered_store):
    pid = script_prompt(layered_store)
    browser.get(served.url + f"#/prompt/{pid}/operator/1")
    wait_for(browser, '#decoded[data-token="1"] tbody tr', 5)
    live = shown_decoded(browser)
    browser.get((exported / "index.html").as_uri())
    rows = wait_for(browser, "#corpus tbody tr", 2)
    assert sorted(r.get_attribute("data-id") for r in rows) == sorted(exported_prompts(layered_store))
    next(r for r in rows if r.get_attribute("data-id") == pid).find_element("css selector", ".prompt-link").click()
    wait_for(browser, '#decoded[data-token="combined"] tbody tr', 5)
    assert css(browser, "#prompt-text")[0].text == layered_store.prompts[pid].text
    css(browser, '#tokens .token[data-index="1"]')[0].click()
    wait_for(browser, '#decoded[data-token="1"] tbody tr', 5)
    assert shown_decoded(browser) == live
    css(browser, '#tabs a[data-tab="layers/attn"]')[0].click()
    assert len(wait_for(browser, "#layers-heatmap rect.cell", 3)) == 3 * layered_store.prompts[pid].n_tokens


def test_a_right_vector_on_the_first_token_is_flagged_as_a_likely_sink(browser, layered_store, monkeypatch):
    import threading

    from detjac.sinks import SINK_NOTE, sink_note
    from detjac.store import open_store
    from detjac.view import prompt_page
    from detjac.view.readonly import ReadOnlyStore
    from detjac.view.server import make_server

    real = prompt_page.decode_spectrum

    def first_on_the_first_token(view, spec, top):  # the store's decoding, its first right vector moved to token 0
        found = real(view, spec, top)
        ids = {k: list(found[k]) for k in ("left_ids", "right_ids", "right_tokens", "right_shares")}
        ids["right_tokens"][0], ids["right_shares"][0] = 0, 0.95
        ids["right_tokens"][1], ids["right_shares"][1] = 0, 0.85  # under the rule's 90 %
        return ids

    monkeypatch.setattr(prompt_page, "decode_spectrum", first_on_the_first_token)
    server = make_server(open_store(layered_store.path))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pid = layered_store.ids[0]
        browser.get(server.url + f"#/prompt/{pid}")
        rows = wait_for(browser, "#decoded tbody tr", 2)
        assert [r.find_elements("css selector", ".sink") != [] for r in rows[:2]] == [True, False]
        assert rows[0].find_element("css selector", ".sink").text == f"· {SINK_NOTE}"
        payload = prompt_page.operator_payload(ReadOnlyStore(open_store(layered_store.path)), pid, None)
        assert [t["sink"] for t in payload["triplets"]] == \
            [sink_note(t["right_token"], t["right_share"]) for t in payload["triplets"]]
        browser.get(server.url + f"#/prompt/{pid}/operator/0")  # a token's own operator: never flagged
        wait_for(browser, '#decoded[data-token="0"] tbody tr')
        assert css(browser, "#decoded .sink") == []
    finally:
        server.shutdown()
        server.server_close()
