"""The node kinds of attribution graphs, declared once (detjac.graph_nodes): ids made in one place read back to their
node, kinds are distinct, and the viewer's JavaScript names the same kinds. Torch-free."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from detjac.graph_nodes import KINDS, LOGIT, NEURON, TOKEN, TOKEN_LAYER, kind_named, node_id, parse_node_id

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_kinds_ids_read_back_to_their_node(kind):
    layers = [TOKEN_LAYER] if kind is TOKEN else [-1, 0, 7, 31] if kind.name == "constant" else [0, 7, 31]
    for layer in layers:
        for index in ([-1] if "{index}" not in kind.id_format else [0, 3, 12345]):
            for pos in (0, 9):
                made = node_id(kind, layer, index, pos)
                assert parse_node_id(kind, made) == (layer, index, pos), made
                assert kind_named(kind.name) is kind
    assert parse_node_id(kind, "not an id") is None


def test_circuit_tracers_ids_are_kept():
    assert node_id(NEURON, 3, 17, 5) == "3_17_5" and NEURON.feature_of(3, 17, 5) == (3 + 17) * (3 + 17 + 1) // 2 + 17
    assert node_id(TOKEN, TOKEN_LAYER, 502, 2) == "E_502_2" and TOKEN.json_layer(TOKEN_LAYER) == "E"
    assert node_id(LOGIT, 5, 11, 4) == "5_11_4" and LOGIT.feature_of(5, 11, 4) == 11


def test_kinds_are_distinct_and_their_codes_index_the_registry():
    assert [k.code for k in KINDS] == list(range(len(KINDS)))
    assert len({k.name for k in KINDS}) == len(KINDS)
    assert len({k.id_format.split("{")[0] for k in KINDS if k.span == "qk"} | {"B_", "E_"}) == 5  # no prefix shared


def test_the_viewer_names_the_same_kinds_once():
    """One JavaScript constant (graph_layout.js, loaded before the other graph files) holds the kinds' names, and no
    other graph file of the viewer spells one."""
    static = ROOT / "view" / "static"
    text = (static / "graph_layout.js").read_text()
    found = re.search(r"const NODE_KIND = Object\.freeze\(\{(.*?)\}\);", text, re.S)
    assert found, "Expected the NODE_KIND constant in graph_layout.js"
    assert sorted(re.findall(r'"([^"]+)"', found[1])) == sorted(k.name for k in KINDS)
    for name in ("graph_layout.js", "graph_page.js", "graph_panels.js", "graph_heads.js", "graph_groups.js"):
        body = (static / name).read_text().replace(found[0], "")
        spelled = [k.name for k in KINDS if f'"{k.name}"' in body]
        assert not spelled, f"Expected {name} to name node kinds through NODE_KIND. Got {spelled} spelled out."
