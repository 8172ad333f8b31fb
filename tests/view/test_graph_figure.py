"""The pinned nodes a graph JSON carries (``qParams.pinnedIds``, as the page's "save as a new graph JSON" writes
them) reach the page checked: each a node of the graph, once, in the file's order; anything else is refused in one
line before the page is drawn."""

from __future__ import annotations

import pytest

from detjac.errors import InvalidArgumentError
from detjac.view.graph_page import graph_payload

GRAPH = {"metadata": {"prompt_tokens": ["a", "b"], "prompt": "ab"},
         "nodes": [{"node_id": "E_1_0", "feature_type": "embedding", "layer": "E", "ctx_idx": 0, "clerp": "a"},
                   {"node_id": "0_3_1", "feature_type": "mlp neuron", "layer": "0", "ctx_idx": 1, "clerp": "n",
                    "activation": -0.5, "influence": 0.2},
                   {"node_id": "2_7_1", "feature_type": "logit", "layer": "2", "ctx_idx": 1,
                    "clerp": 'Output "c" (p=0.500)', "token_prob": 0.5}],
         "links": [{"source": "E_1_0", "target": "0_3_1", "weight": 1.5},
                   {"source": "0_3_1", "target": "2_7_1", "weight": -0.25}]}


def test_pins_reach_the_page_once_each_in_the_files_order():
    page = graph_payload({**GRAPH, "qParams": {"pinnedIds": ["2_7_1", "0_3_1", "2_7_1"], "supernodes": []}})
    assert page["pinned"] == ["2_7_1", "0_3_1"]
    assert graph_payload(GRAPH)["pinned"] == [] and graph_payload({**GRAPH, "qParams": {}})["pinned"] == []


@pytest.mark.parametrize(("pins", "got"), [(["0_3_1", "nowhere"], "Got 'nowhere'."), ("0_3_1", "Got '0_3_1'."),
                                           ([["0_3_1"]], "Got \"['0_3_1']\".")])
def test_pins_that_are_not_node_ids_of_the_graph_are_refused_in_one_line(pins, got):
    with pytest.raises(InvalidArgumentError) as info:
        graph_payload({**GRAPH, "qParams": {"pinnedIds": pins}}, "g.json")
    message = str(info.value)
    assert message == f"Expected qParams.pinnedIds of g.json to be a list of its node ids. {got}"
