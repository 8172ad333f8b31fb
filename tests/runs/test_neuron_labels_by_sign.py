"""A neuron's label leads with the side it fires on: a graph node with a negative activation is labelled by its top
negative contexts and the tokens its write vector lowers, the sign stated; a positive one keeps its positive label."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from click.testing import CliRunner
from store_helpers import write_prompts

from detjac.analysis import clerp, neuron_page, relabel
from detjac.cli.main import main
from detjac.runs import NeuronOptions, build_neuron_index
from detjac.store import open_neuron_index

PROMPTS = ["The capital of France is", "Paris is a city in France"]


@pytest.fixture(scope="module")
def index_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("signed-labels")
    prompts = write_prompts(folder / "p.txt", PROMPTS)
    build_neuron_index("default", prompts, folder / "n.zarr", NeuronOptions(top_k=3), progress=False)
    return folder / "n.zarr"


def _side_tokens(index, layer, neuron, sign):
    """The tokens at the neuron's top contexts of ``sign`` (0 positive, 1 negative), as the index holds them."""
    a = index.arrays
    ids = [int(index.prompt_tokens(int(p))[int(q)]) for p, q in
           zip(a["top_prompt"][layer, neuron, sign], a["top_position"][layer, neuron, sign], strict=True) if p >= 0]
    return index.token_text(ids)


def _two_sided(index):
    """A neuron whose top positive and negative contexts differ in their most frequent token."""
    layers, per_layer = index.shape
    for layer in range(layers):
        for neuron in range(per_layer):
            pos, neg = _side_tokens(index, layer, neuron, 0), _side_tokens(index, layer, neuron, 1)
            if pos and neg and Counter(pos).most_common(1)[0][0] != Counter(neg).most_common(1)[0][0]:
                return layer, neuron
    raise AssertionError("no neuron of the index has two distinct sides")


def test_a_negative_activation_gets_the_negative_label(index_path):
    index = open_neuron_index(index_path)
    layer, neuron = _two_sided(index)
    negative, positive = clerp(index, layer, neuron, -0.25), clerp(index, layer, neuron, 0.25)
    top_negative = Counter(_side_tokens(index, layer, neuron, 1)).most_common(1)[0][0]
    top_positive = Counter(_side_tokens(index, layer, neuron, 0)).most_common(1)[0][0]
    assert negative.startswith(f"− top {top_negative!r} ×")
    lowers = [int(i) for i in index.arrays["write_ids"][layer, neuron, 1][:3] if i >= 0]
    assert negative.endswith("lowers " + " ".join(repr(t) for t in index.token_text(lowers)))
    assert positive == clerp(index, layer, neuron) and positive.startswith(f"top {top_positive!r} ×")
    assert "writes " in positive and "lowers" not in positive and not positive.startswith("−")
    page = neuron_page(index, layer, neuron)
    assert (page["clerp"], page["clerp_negative"]) == (positive, negative)


def test_relabel_follows_each_neurons_sign(index_path):
    index = open_neuron_index(index_path)
    layer, neuron = _two_sided(index)
    neurons = np.array([[layer, neuron, 0], [layer, neuron, 1], [layer, neuron, 2]])
    labels = relabel(["a", "b", "c"], neurons, index, activations=np.array([1.5, -2.0, 0.0]))
    assert labels == [clerp(index, layer, neuron), clerp(index, layer, neuron, -2.0), clerp(index, layer, neuron)]
    assert labels[0] != labels[1] and labels[1].startswith("− ")
    assert relabel(["a"], neurons[:1], index) == [clerp(index, layer, neuron)]  # no activations: the positive side


def test_a_graph_labels_each_neuron_by_its_sign_here(index_path, tmp_path):
    path = tmp_path / "g.json"
    result = CliRunner().invoke(main, ["graph", "-p", PROMPTS[0], "--out", str(path), "--max-nodes", "30",
                                       "--neurons", str(index_path)])
    assert result.exit_code == 0, result.output
    index = open_neuron_index(index_path)
    neurons = [n for n in json.loads(path.read_text())["nodes"] if n["feature_type"] == "mlp neuron"]
    negative = [n for n in neurons if n["activation"] < 0]
    assert negative and len(negative) < len(neurons)  # both signs among the graph's neurons
    for node in neurons:
        layer, idx, _ = (int(x) for x in node["node_id"].split("_"))
        assert node["clerp"] == clerp(index, layer, idx, node["activation"])
        assert node["clerp"].startswith("− ") == (node["activation"] < 0)
