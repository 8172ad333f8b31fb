"""Fixtures of the viewer's tests: a synthetic store (``detjac.store.testing``: no torch, no model), a live
``detjac view`` on it, its static export, and a headless Chromium (``detjac.view.headless``).

Without chromium, chromedriver or selenium the browser tests (``test_view_browser.py``) are skipped,
with one line in the summary saying what is missing and how to install it.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from view_helpers import NEURON_TEXTS, TEXTS, exported_prompts, viewer_model, write_default_graph

from detjac.store.testing import layer_targets, make_store
from detjac.view.headless import Served, new_driver
from detjac.view.headless import detjac_command as detjac


@pytest.fixture(scope="session")
def layered_store(tmp_path_factory):
    """Four prompts, three layers, every layer's layer, attn, mlp and mlp_local targets. Never written to by a
    test (the viewer must show it as it is): tests that run analyses work on a copy."""
    path = tmp_path_factory.mktemp("view") / "layered.zarr"
    return make_store(path, prompts=TEXTS, n_layers=3, targets=layer_targets(3, "layer,attn,mlp,mlp_local"),
                      model=viewer_model())


@pytest.fixture(scope="session")
def served(layered_store):
    server = Served(layered_store.path)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def exported(layered_store, tmp_path_factory):
    """``detjac view --export`` of two prompts of the layered store (the one with markup among them): the folder."""
    out = tmp_path_factory.mktemp("export") / "pages"
    chosen = exported_prompts(layered_store)
    done = subprocess.run(detjac("view", str(layered_store.path), "--export", str(out), "--prompt-id", chosen[0],
                                 "--prompt-id", chosen[1]), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="session")
def browser():
    """A headless Chromium (the browser tests skip their module when there is none: test_view_browser.py)."""
    driver = new_driver()
    yield driver
    driver.quit()


@pytest.fixture(scope="session")
def graph_file(tmp_path_factory):
    """``detjac graph`` on the default model (view_helpers.GRAPH_PROMPT): the JSON file. Read only."""
    return write_default_graph(tmp_path_factory.mktemp("graph") / "copper.json")


@pytest.fixture(scope="module")
def graph(graph_file):
    """The default model's graph JSON (:func:`graph_file`), parsed."""
    return json.loads(graph_file.read_text())


@pytest.fixture(scope="module")
def graph_served(graph_file):
    """``detjac view`` of the graph file."""
    server = Served(graph_file)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def neuron_index(tmp_path_factory):
    """A neuron index of the default model (``detjac neurons``) on :data:`NEURON_TEXTS` (markup among them): its
    folder. Read only."""
    from detjac.runs import NeuronOptions, build_neuron_index

    folder = tmp_path_factory.mktemp("neuron-pages")
    (folder / "p.txt").write_text("".join(f"{t}\n" for t in NEURON_TEXTS), encoding="utf-8")
    build_neuron_index("default", folder / "p.txt", folder / "n.zarr", NeuronOptions(top_k=4), progress=False)
    return folder / "n.zarr"
