"""``detjac view graph.json --neurons INDEX --export DIR``: the snapshot holds the neuron page of every neuron of its
graph (and of no other neuron), each equal to :func:`detjac.analysis.neuron_page` with its top contexts as text, under
the name the page loads for a clicked node; another model's index is refused, nothing written. No server, no
browser (the click itself, from ``file://``: ``test_neuron_page_browser.py``)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner
from neuron_helpers import resealed

from detjac.analysis import neuron_page
from detjac.cli.main import main
from detjac.store import open_neuron_index
from detjac.view.jsonable import jsonable
from detjac.view.static_export import data_file


def read_data(path):
    """The key and data of a snapshot's ``data/<key>.js`` (``detjacData(key, data);``)."""
    text = path.read_text(encoding="ascii")
    assert text.startswith("detjacData(") and text.endswith(");\n")
    decoder = json.JSONDecoder()
    key, end = decoder.raw_decode(text, len("detjacData("))
    data, _ = decoder.raw_decode(text, end + 2)
    return key, data


@pytest.fixture(scope="module")
def exported(graph_file, neuron_index, tmp_path_factory):
    out = tmp_path_factory.mktemp("neuron-export") / "pages"
    result = CliRunner().invoke(main, ["view", str(graph_file), "--neurons", str(neuron_index), "--export", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_the_export_holds_the_page_of_every_neuron_of_its_graph_and_no_other(exported, neuron_index):
    out, output = exported
    index = open_neuron_index(neuron_index)
    _, graph = read_data(out / data_file("graph"))
    ids = [n["id"] for n in graph["nodes"] if n["type"] == "mlp neuron"]
    neurons = sorted({tuple(int(x) for x in i.split("_")[:2]) for i in ids})
    assert neurons and len(neurons) < index.shape[0] * index.shape[1]
    written = sorted(p.name for p in (out / "data").glob("neuron.*.js"))
    assert written == sorted(f"neuron.{layer}.{neuron}.js" for layer, neuron in neurons)
    assert f"({len(neurons)} neuron pages)" in output
    key, listed = read_data(out / data_file("neurons"))
    assert key == "neurons" and listed["only"] == [list(x) for x in neurons]
    _, corpus = read_data(out / data_file("corpus"))
    assert corpus["neurons"] is True  # what starts the page's neuron script
    for node_id in ids:  # a clicked node's page: the name neuron_page.js loads for its id (layer_index_position)
        layer, neuron, _ = re.fullmatch(r"(\d+)_(\d+)_(\d+)", node_id).groups()
        path = out / data_file(f"neuron/{layer}/{neuron}")
        key, page = read_data(path)
        assert key == f"neuron/{layer}/{neuron}"
        assert page == json.loads(json.dumps(jsonable(neuron_page(index, int(layer), int(neuron)))))
        text = path.read_text(encoding="ascii")
        for context in page["contexts"]["positive"]:  # its top contexts, as JSON strings (text, never markup)
            assert json.dumps(context["token"]) in text
    script = (out / "neuron_page.js").read_text()
    assert '"data/" + key.split("/").join(".") + ".js"' in script  # the same names as data_file


def test_an_index_of_another_model_is_refused_and_nothing_written(graph_file, neuron_index, tmp_path):
    other = resealed(neuron_index, tmp_path / "other.zarr", {"weights_sha256": "f" * 64})
    out = tmp_path / "pages"
    result = CliRunner().invoke(main, ["view", str(graph_file), "--neurons", str(other), "--export", str(out)])
    assert result.exit_code != 0
    assert "weights_sha256: 'ffff" in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("position", [-3, 999])
def test_a_resealed_index_pointing_outside_its_prompts_is_refused_and_nothing_written(graph_file, neuron_index,
                                                                                        tmp_path, position):
    arrays = open_neuron_index(neuron_index).arrays
    changed = arrays["top_position"].copy()
    changed[tuple(np.argwhere(arrays["top_prompt"] >= 0)[0])] = position  # Python would read -3 from the end
    bad = resealed(neuron_index, tmp_path / "bad.zarr", arrays={"top_position": changed})
    out = tmp_path / "pages"
    result = CliRunner().invoke(main, ["view", str(graph_file), "--neurons", str(bad), "--export", str(out)])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
    message = result.output.strip()
    assert len(message.splitlines()) == 1 and f"top_position {position} outside its prompt" in message, message
    assert [p.name for p in tmp_path.iterdir()] == ["bad.zarr"]  # no pages, no .pages.tmp-* folder


@pytest.mark.parametrize("key", ["neuron/²/5", "neuron/0/٣", "neuron/01/2", "neuron/0/-1", "neuron/0", "neuron/0/9999"])
def test_a_neuron_key_not_written_in_ascii_digits_or_out_of_range_is_not_found(neuron_index, key):
    from detjac.view.neuron_page import NeuronPages
    from detjac.view.pages import NotFound

    pages = NeuronPages(None, open_neuron_index(neuron_index))
    with pytest.raises(NotFound):
        pages.data(key)
