"""What ``detjac view`` serves, without a browser: each page's data against the analyses, the server's safety
rules (read-only, nothing outside the store, loopback by default), and the static export.

Synthetic stores (``detjac.store.testing``): no torch, no model.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from http.client import HTTPConnection

import numpy as np
import pytest
from click.testing import CliRunner
from view_helpers import SCRIPT_WORD, TEXTS, copy_store, exported_prompts, script_prompt

from detjac.analysis import layers as layer_analysis
from detjac.analysis.decoded import decode_report
from detjac.cli.main import main
from detjac.errors import InvalidArgumentError, StoreError
from detjac.store import create_store, open_store
from detjac.store.testing import make_store, run_description, synthetic_model, synthetic_prompt, write_prompt
from detjac.view.headless import Served
from detjac.view.pages import NotFound, Pages
from detjac.view.server import is_loopback, make_server
from detjac.view.static_export import data_file, export_static


def store_files(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_the_corpus_lists_every_prompt_and_every_failure(layered_store, tmp_path):
    path = copy_store(layered_store, tmp_path)
    with create_store(path, layered_store.run) as writer:
        writer.record_failure("f00d" * 4, {"prompt": "far too long", "line": 9,
                                           "reason": "Expected at most 256 tokens.",
                                       "error": "PromptError", "stage": "tokenize"})
    data = Pages(open_store(path)).data("corpus")
    assert [row["id"] for row in data["prompts"]] == layered_store.ids
    for row in data["prompts"]:
        truth = layered_store.prompts[row["id"]]
        attrs = open_store(path).get(row["id"]).attrs
        assert row["text"] == truth.text and row["n_tokens"] == truth.n_tokens
        assert row["error"] == attrs["reconstruction_error"] and row["next_token_id"] == truth.next_token_id
        assert row["layerwise"] == 12 and not row["low_rank"]
    assert data["failures"] == [{"id": "f00d" * 4, "text": "far too long", "line": 9, "stage": "tokenize",
                                 "error": "PromptError", "reason": "Expected at most 256 tokens.",
                                 "failed_at": data["failures"][0]["failed_at"]}]
    assert data["store"]["run"]["layerwise"] == layered_store.run["layerwise"]


@pytest.mark.parametrize("token", [None, 0, 3])
def test_decoded_triplets_are_those_of_analyze_svd(layered_store, tmp_path, token):
    """The operator page computes in memory what `detjac analyze svd` computes and keeps (its defaults)."""
    pages = Pages(layered_store.open())
    pid = layered_store.ids[0]
    shown = pages.data(f"prompt/{pid}/operator/{'combined' if token is None else token}")
    assert "computed now" in shown["source"]
    cli = decode_report(open_store(copy_store(layered_store, tmp_path)), [pid], token=token).spectra[0]
    assert len(shown["triplets"]) == len(cli.triplets) == 5
    for mine, theirs in zip(shown["triplets"], cli.triplets, strict=True):
        assert " ".join(mine["left"]) == theirs.left and " ".join(mine["right"]) == theirs.right
        assert mine["sigma"] == theirs.sigma and mine["right_token"] == theirs.right_token
        assert np.isclose(sum(mine["token_shares"]), 1.0)
    assert open_store(layered_store.path).analysis_names(pid) == []  # nothing was written to the store


def test_analyses_kept_in_the_store_are_shown_not_recomputed(layered_store, tmp_path):
    path = copy_store(layered_store, tmp_path)
    pid = layered_store.ids[1]
    result = CliRunner().invoke(main, ["analyze", "svd", str(path), "--prompt-id", pid, "--token", "-1", "--k", "3"])
    assert result.exit_code == 0, result.output
    pages = Pages(open_store(path))
    last = layered_store.prompts[pid].n_tokens - 1
    shown = pages.data(f"prompt/{pid}/operator/{last}")
    assert "kept in the store" in shown["source"] and len(shown["triplets"]) == 3
    stored, _ = open_store(path).read_analysis(pid, "svd_token-1")
    assert [t["sigma"] for t in shown["triplets"]] == stored["S"].tolist()
    listed = pages.data(f"prompt/{pid}")["analyses"]
    assert [a["name"] for a in listed] == ["svd_token-1"] and listed[0]["attrs"]["params"]["k"] == 3


def test_the_prompt_page_shows_tokens_prediction_errors_and_spectra(layered_store):
    pages = Pages(layered_store.open())
    pid = script_prompt(layered_store)
    truth, model = layered_store.prompts[pid], layered_store.model
    data = pages.data(f"prompt/{pid}")
    assert data["text"] == truth.text and data["tokens"] == [model.words[i] for i in truth.token_ids]
    assert SCRIPT_WORD in data["tokens"]
    logits = model.unembedding @ truth.output
    p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    top = data["prediction"]["top"]
    assert top[0]["id"] == truth.next_token_id == data["next_token_id"]
    np.testing.assert_allclose([t["p"] for t in top], np.sort(p)[::-1][:10], rtol=1e-12)
    J = truth.jacobian
    np.testing.assert_allclose(data["spectra"]["combined"]["S"], np.linalg.svd(J.reshape(8, -1), compute_uv=False),
                               rtol=1e-10)
    for k, entry in enumerate(data["spectra"]["tokens"]):
        exact = np.linalg.svd(J[:, k, :], compute_uv=False)
        np.testing.assert_allclose(entry["S"], exact, rtol=1e-10)
        assert np.isclose(entry["sigma_1"], exact[0]) and np.isclose(entry["frobenius"], np.linalg.norm(J[:, k, :]))
    assert data["kinds"] == ["attn", "layer", "mlp", "mlp_local"]
    assert set(data["errors"]["layerwise"]) == set(layered_store.run["layerwise"])


def test_the_layers_tab_discovers_the_kinds_and_agrees_with_analyze_layers(layered_store, tmp_path):
    pages = Pages(layered_store.open())
    pid = layered_store.ids[0]
    other = open_store(copy_store(layered_store, tmp_path))  # the analyses keep their results in the store
    for kind in pages.data(f"prompt/{pid}")["kinds"]:
        data = pages.data(f"prompt/{pid}/layers/{kind}")
        targets = [f"{kind}.{layer}" for layer in range(3)]
        assert [r["target"] for r in data["rows"]] == targets and data["heatmap"]["layers"] == [0, 1, 2]
        rows = layer_analysis.layer_table(other, [pid], targets=targets)
        for mine, theirs in zip(data["rows"], rows, strict=True):
            assert (mine["stable_rank"], mine["u1_rank"], mine["lens_rank"], mine["n90"]) == \
                   (theirs["stable_rank"], theirs["u1_rank"], theirs["lens_rank"], theirs["n90"])
        component, local = kind.removesuffix("_local"), kind.endswith("_local")
        heat = layer_analysis.token_heatmap(other, pid, component, local=local)
        assert data["heatmap"]["u1_rank"] == heat["u1_rank"].tolist()
        assert data["heatmap"]["contribution_rank"] == heat["contribution_rank"].tolist()
    assert open_store(layered_store.path).analysis_names(pid) == []


def test_a_low_rank_prompt_shows_its_stored_triplets(tmp_path):
    synthetic = make_store(tmp_path / "lr.zarr", prompts=["the oak tree grows"], keep="rank:3")
    pages = Pages(synthetic.open())
    pid = synthetic.ids[0]
    prompt = synthetic.open().get(pid)
    data = pages.data(f"prompt/{pid}")
    assert data["low_rank"] and data["kinds"] == []
    np.testing.assert_array_equal(data["spectra"]["combined"]["S"], prompt.triplets()[1])
    op = pages.data(f"prompt/{pid}/operator/2")
    assert "stored triplets" in op["source"] and [t["sigma"] for t in op["triplets"]] == prompt.triplets(2)[1].tolist()


def test_page_keys_are_looked_up_never_used_as_paths(layered_store):
    pages = Pages(layered_store.open())
    pid = layered_store.ids[0]
    for key in ["../model", "prompt/../../model", f"prompt/{pid}/../../model", "prompt/..", f"prompt/{pid}/operator/9",
                f"prompt/{pid}/operator/-1", f"prompt/{pid}/operator/01", f"prompt/{pid}/layers/../layer",
                f"prompt/{pid}/layers/output", "prompt/0000000000000000", "", "corpus/x"]:
        with pytest.raises(NotFound):
            pages.data(key)


# -- the server --------------------------------------------------------------------------------------------------------

def get(url, method="GET", host=None):
    """(status, headers, body) of one request; no redirects are involved."""
    parts = re.match(r"http://([^/:]+):(\d+)(/.*)", url)
    conn = HTTPConnection(parts.group(1), int(parts.group(2)), timeout=30)
    headers = {"Host": host} if host else {}
    conn.request(method, parts.group(3), headers=headers)
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()


def test_the_server_serves_the_page_and_its_data_read_only(served, layered_store):
    before = store_files(layered_store.path)
    status, headers, body = get(served.url)
    assert status == 200 and b'<meta name="detjac-mode" content="server">' in body
    assert "script-src 'self'" in headers["Content-Security-Policy"] and headers["X-Content-Type-Options"] == "nosniff"
    assert b"http://" not in body and b"https://" not in body  # nothing is fetched from elsewhere
    for name in ("app.js", "charts.js", "style.css"):
        status, _, script = get(served.url + name)
        assert status == 200 and b"https://" not in script
        assert b"http://" not in script.replace(b"http://www.w3.org/2000/svg", b"")  # SVG's namespace name only
    status, headers, body = get(served.url + "api/corpus")
    assert status == 200 and headers["Content-Type"] == "application/json"
    texts = [layered_store.prompts[i].text for i in layered_store.ids]
    assert [r["text"] for r in json.loads(body)["prompts"]] == texts
    pid = layered_store.ids[0]
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        status, headers, _ = get(served.url + f"api/prompt/{pid}", method)
        assert status == 405 and headers["Allow"] == "GET, HEAD"
    assert get(served.url + f"api/prompt/{pid}/operator/1")[0] == 200
    assert store_files(layered_store.path) == before  # nothing written, analyses included


@pytest.mark.parametrize("path", ["/../../../etc/passwd", "/..%2f..%2fetc%2fpasswd", "/api/prompt/..%2Fmodel",
                                  "/api/../api/corpus/../../zarr.json", "/api/prompt/../../zarr.json", "/zarr.json",
                                  "/model/tokenizer.json", "/static/../view/server.py", "/%2e%2e/%2e%2e/etc/passwd",
                                  "/api/prompt/{pid}/../../../zarr.json", "/app.js/../../zarr.json"])
def test_nothing_outside_the_page_and_its_data_is_served(served, layered_store, path):
    status, _, body = get(served.url.rstrip("/") + path.format(pid=layered_store.ids[0]))
    assert status == 404, body
    assert b"detjac_store" not in body and b"root:" not in body


def test_a_foreign_host_header_is_refused(served):
    port = served.url.rsplit(":", 1)[1].strip("/")
    assert get(served.url + "api/corpus", host=f"evil.example:{port}")[0] == 403
    assert get(served.url + "api/corpus", host=f"localhost:{port}")[0] == 200


def test_the_server_binds_loopback_by_default_and_says_when_it_does_not(layered_store):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")
    assert re.match(r"detjac view: serving 4 prompts of .* at http://127\.0\.0\.1:\d+/", served_line(layered_store))
    open_server = Served(layered_store.path, "--host", "0.0.0.0")
    assert "http://0.0.0.0:" in open_server.url
    assert "not a loopback address: anyone who can reach this machine" in open_server.stop()
    server = make_server(layered_store.open())
    try:
        assert server.server_address[0] == "127.0.0.1" and server.port > 0
        with pytest.raises(InvalidArgumentError, match=f"Got 127.0.0.1:{server.port}"):
            make_server(layered_store.open(), port=server.port)  # taken
    finally:
        server.server_close()


def served_line(layered_store):
    server = Served(layered_store.path)
    server.stop()
    return server.first_line


# -- the static export -------------------------------------------------------------------------------------------------

def test_the_export_holds_the_pages_with_the_servers_data(layered_store, exported, served):
    before = store_files(layered_store.path)
    assert (exported / "index.html").read_bytes().count(b'content="static"') == 1
    chosen = exported_prompts(layered_store)
    keys = list(Pages(layered_store.open()).keys(chosen))
    assert len(keys) == 1 + sum(2 + layered_store.prompts[pid].n_tokens + 4 for pid in chosen)
    assert sorted(p.name for p in (exported / "data").iterdir()) == sorted(data_file(k)[5:] for k in keys)
    for key in keys:
        text = (exported / data_file(key)).read_text(encoding="ascii")
        prefix = f"detjacData({json.dumps(key)}, "
        assert text.startswith(prefix) and text.endswith(");\n")
        data = json.loads(urllib.request.urlopen(served.url + "api/" + key).read())
        if key == "corpus":
            data["prompts"] = [row for row in data["prompts"] if row["id"] in chosen]
        assert json.loads(text[len(prefix):-3]) == data
    assert store_files(layered_store.path) == before


def test_the_export_refuses_a_folder_in_use_and_unknown_prompts(layered_store, tmp_path):
    pid = layered_store.ids[2]
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgumentError, match="Expected a new or empty folder. Got .* not empty"):
        export_static(layered_store.open(), tmp_path / "one")
    with pytest.raises(InvalidArgumentError, match="Expected complete prompts of .* Got nope"):
        export_static(layered_store.open(), tmp_path / "two", ["nope"])
    assert not (tmp_path / "two").exists()  # refused before anything is written
    result = CliRunner().invoke(main, ["view", str(layered_store.path), "--prompt-id", pid])
    assert result.exit_code == 2 and "--prompt-id applies to --export only" in result.output


def test_view_help_has_examples():
    result = CliRunner().invoke(main, ["view", "--help"])
    assert result.exit_code == 0 and "detjac view run.zarr --export run-pages/" in result.output
    assert TEXTS  # the session's prompts are the ones the browser tests use too


def test_a_store_without_the_models_matrices_shows_what_it_can(tmp_path):
    """No unembedding: no prediction and no decoded tokens (the page says why), the rest is shown."""
    model = synthetic_model()
    run = run_description(model, n_layers=2)
    with create_store(tmp_path / "bare.zarr", run) as store:  # created without model_data
        truth = synthetic_prompt(model, run, "the oak tree grows", n_layers=2)
        write_prompt(store, model, run, truth)
    server = make_server(open_store(tmp_path / "bare.zarr"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        status, _, body = get(server.url + f"api/prompt/{truth.id}")
        page = json.loads(body)
        assert status == 200 and "Expected a model array 'unembedding'" in page["prediction"]["error"]
        np.testing.assert_allclose(page["spectra"]["combined"]["S"],
                                   np.linalg.svd(truth.jacobian.reshape(8, -1), compute_uv=False), rtol=1e-10)
        status, _, body = get(server.url + f"api/prompt/{truth.id}/operator/1")
        assert status == 422 and "cannot decode" in json.loads(body)["error"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_damaged_prompt_is_listed_with_why_and_its_page_says_so(layered_store, tmp_path):
    path = copy_store(layered_store, tmp_path)
    pid = layered_store.ids[1]
    meta = json.loads((path / "prompts" / pid / "zarr.json").read_text())
    meta["attributes"]["prompt"] = "an edited text"
    (path / "prompts" / pid / "zarr.json").write_text(json.dumps(meta))
    pages = Pages(open_store(path))
    rows = {row["id"]: row for row in pages.data("corpus")["prompts"]}
    assert len(rows) == len(layered_store.ids) and "attributes changed since commit" in rows[pid]["damage"]
    assert all("damage" not in row for other, row in rows.items() if other != pid)
    with pytest.raises(StoreError, match=f"Expected an intact prompt {pid}"):
        pages.data(f"prompt/{pid}")


def test_an_export_the_disk_refuses_midway_leaves_nothing_and_says_so_in_one_line(layered_store, tmp_path,
                                                                                monkeypatch):
    """A full disk after index.html: no half-written folder (a 0-byte index.html), a StoreError, not an OSError."""
    import errno
    from pathlib import Path

    real = Path.write_text

    def full_disk(self, *args, **kwargs):
        if self.suffix == ".js":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    out = tmp_path / "snap"
    with pytest.raises(StoreError, match=r"Expected to write the snapshot into .*snap\. Got No space left on device"):
        export_static(layered_store.open(), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the folder nor the one written aside


def test_each_prompt_is_opened_once_and_the_tokenizer_parsed_once(layered_store):
    """An export asks for a prompt once per page (its page, one per operator, its graph) and for
    the tokenizer on every page; the viewer opens (and checks) each prompt once and parses the tokenizer once."""
    from detjac.analysis import piece_reader
    from detjac.analysis.jobs import stored_tokenizer
    from detjac.store import open_store
    from detjac.view.pages import Pages

    store = open_store(layered_store.path)
    opened: list[str] = []
    real_get = store.get

    def counting_get(pid):
        opened.append(pid)
        return real_get(pid)

    store.get = counting_get
    pages = Pages(store)
    pid = store.prompt_ids()[0]
    keys = [k for k in pages.keys([pid]) if k != "corpus"]
    assert len(keys) >= 3
    for key in keys:
        pages.data(key)
    assert opened.count(pid) == 1
    assert stored_tokenizer(pages.view) is stored_tokenizer(pages.view) is not None
    assert piece_reader(pages.view)(3) == piece_reader(store)(3)
