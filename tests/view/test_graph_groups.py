"""Groups (supernodes) on the graph page, without a browser: a collapsed group's links equal its members' sums
(against :func:`detjac.analysis.group_adjacency`'s ``S A Sᵀ`` on the graph's own links, to float64 rounding, with
every group collapsed and with one expanded), a group's incoming links still sum to its value within its members'
errors, and supernodes that are not groups of one layer's neurons are refused in one line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from detjac.analysis import group_adjacency, group_completeness
from detjac.errors import InvalidArgumentError
from detjac.graph_settings import GraphSettings
from detjac.view.graph_file import GraphFile
from detjac.view.graph_groups import PREFIX, drawn
from detjac.view.graph_page import graph_payload

HOSTILE = '<img src=x onerror="alert(1)"> group'


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """The default model's graph of a short prompt, unpruned (every link kept), with each layer's neurons grouped
    three by three (a grouping need not agree on anything to be exact): the JSON file, its page and the graph."""
    from detjac.engine import load_engine
    from detjac.graphs import attribution_graph, write_graph

    g = attribution_graph(load_engine("default"), "Copper, n. A", GraphSettings(max_nodes=40))
    rows: dict[int, list[int]] = {}
    for i, (layer, _, _) in enumerate(g.neurons.tolist()):
        rows.setdefault(layer, []).append(i)
    groups = [members[k:k + 3] for members in rows.values() for k in range(0, len(members) - 2, 3)]
    path = tmp_path_factory.mktemp("groups") / "g.json"
    write_graph(g, path, model="default", node_threshold=1.0, edge_threshold=1.0,
                supernodes=[(HOSTILE if k == 0 else f"group {k}", m) for k, m in enumerate(groups)])
    return path, GraphFile(path).graph, g


def dense(page, order):
    """The page's links as a ``[target, source]`` matrix over the node ids ``order``."""
    at = {i: k for k, i in enumerate(order)}
    A = np.zeros((len(order), len(order)))
    for link in page["links"]:
        A[at[link["target"]], at[link["source"]]] += link["weight"]
    return A


@pytest.mark.parametrize("expanded", [(), (f"{PREFIX}0",)], ids=["collapsed", "one-expanded"])
def test_a_groups_links_are_its_members_sums(grouped, expanded):
    _, page, _ = grouped
    groups = page["groups"]["nodes"]
    assert len(groups) >= 2 and groups[0]["name"] == HOSTILE and groups[0]["clerp"].startswith(HOSTILE)
    neurons = [n["id"] for n in page["nodes"] if n["type"] == "mlp neuron"]
    others = [n["id"] for n in page["nodes"] if n["type"] != "mlp neuron"]
    A = dense(page, neurons + others)
    collapsed = [g for g in groups if g["id"] not in expanded]
    members = [[neurons.index(m) for m in g["members"]] for g in collapsed]
    values = np.array([next(n["activation"] for n in page["nodes"] if n["id"] == i) for i in neurons])
    B, grouped_values, _ = group_adjacency(A, values, members, len(neurons))  # S A Sᵀ: the independent sums
    singles = [i for k, i in enumerate(neurons) if not any(k in m for m in members)]
    order = singles + [g["id"] for g in collapsed] + others
    nodes, links = drawn(page, expanded)
    assert sorted(n["id"] for n in nodes) == sorted(order)
    assert len({(x["source"], x["target"]) for x in links}) == len(links)  # each pair of ends drawn once
    got = dense({"links": links}, order)
    scale = np.abs(A).sum()
    np.testing.assert_allclose(got, B, rtol=1e-14, atol=1e-15 * scale)
    assert np.count_nonzero(got) == np.count_nonzero(B)
    by_id = {n["id"]: n for n in nodes}
    for k, g in enumerate(collapsed, start=len(singles)):
        assert by_id[g["id"]]["activation"] == pytest.approx(grouped_values[k], rel=1e-15)
        assert by_id[g["id"]]["row"] == int(g["layer"]) + 1 and g["size"] == len(g["members"])


def test_completeness_and_influence_hold_on_the_collapsed_graph(grouped):
    _, page, g = grouped
    by_id = {n["id"]: n for n in page["nodes"]}
    full_nodes, full_links = drawn(page, [x["id"] for x in page["groups"]["nodes"]])
    nodes, links = drawn(page)
    incoming = lambda ls, i: math.fsum(x["weight"] for x in ls if x["target"] == i)  # noqa: E731
    row = {f"{layer}_{index}_{pos}": k for k, (layer, index, pos) in enumerate(g.neurons.tolist())}
    carried = g.kept_share[:g.n_neurons] * g.activations  # what a neuron's edges from the graph's nodes carry
    scale = np.abs(g.adjacency).max()
    for i in (n["id"] for n in full_nodes if n["type"] == "mlp neuron"):
        assert incoming(full_links, i) == pytest.approx(carried[row[i]], rel=1e-12, abs=1e-13 * scale)
    groups = [[row[m] for m in x["members"]] for x in page["groups"]["nodes"]]
    # over every neuron of the model a group's incoming edges miss its value by its members' misses only
    assert g.worst_completeness < 1e-12 and group_completeness(g.completeness, g.activations, groups) < 1e-12
    for x, members in zip(page["groups"]["nodes"], groups, strict=True):
        assert x["activation"] == pytest.approx(g.activations[members].sum(), rel=1e-15)
        assert incoming(links, x["id"]) == pytest.approx(carried[members].sum(), rel=1e-12, abs=1e-13 * scale)
        assert x["influence"] == min(by_id[m]["influence"] for m in x["members"])  # kept while a member is
        assert 0 <= x["influence"] <= 1
    for logit in (n["id"] for n in nodes if n["type"] == "logit"):  # the same numbers, summed in another grouping
        assert incoming(links, logit) == pytest.approx(incoming(full_links, logit), rel=1e-13)


CASES = {"not-a-list": ("nope", "Got str"),
         "short": ([["g", "x"]], "Got group 0: ['g', 'x']")}
SKIPPED = {"unknown": ([["g", "NEURON_A", "nowhere"]], "'nowhere' is no neuron of this graph"),
           "token": ([["g", "NEURON_A", "TOKEN"]], "is no neuron of this graph"),
           "two-layers": ([["g", "NEURON_A", "OTHER_LAYER"]], "neurons of layers"),
           "twice": ([["g", "NEURON_A", "NEURON_B"], ["h", "NEURON_A", "NEURON_C"]], "also in group 0")}


def _named(graph: dict) -> dict[str, str]:
    neurons = [n for n in graph["nodes"] if n["feature_type"] == "mlp neuron"]
    layer = max((n["layer"] for n in neurons), key=lambda x: sum(n["layer"] == x for n in neurons))
    same = [n["node_id"] for n in neurons if n["layer"] == layer]
    return {"NEURON_A": same[0], "NEURON_B": same[1], "NEURON_C": same[2],
            "TOKEN": next(n["node_id"] for n in graph["nodes"] if n["feature_type"] == "embedding"),
            "OTHER_LAYER": next(n["node_id"] for n in neurons if n["layer"] != layer)}


@pytest.mark.parametrize("case", CASES)
def test_supernodes_that_are_not_a_list_of_groups_are_refused_in_one_line(grouped, case):
    path, _, _ = grouped
    graph = json.loads(path.read_text())
    supernodes, expected = CASES[case]
    with pytest.raises(InvalidArgumentError) as info:
        graph_payload({**graph, "qParams": {"supernodes": supernodes}}, "g.json")
    message = str(info.value)
    assert "Expected qParams.supernodes of g.json" in message and expected in message
    assert len(message.splitlines()) == 1


@pytest.mark.parametrize("case", SKIPPED)
def test_a_group_that_is_not_one_layer_s_neurons_is_left_expanded_with_its_reason(grouped, case):
    """A hand-made group (across layers, naming a pruned node, ...) does not stop the page: it is not drawn collapsed
    (that would not be exact), the others are, and the groups' note says which and why."""
    path, _, _ = grouped
    graph = json.loads(path.read_text())
    names = _named(graph)
    supernodes, expected = SKIPPED[case]
    supernodes = [[names.get(x, x) for x in g] for g in supernodes]
    good = [["fine", names["NEURON_B"], names["NEURON_C"]]] if case != "twice" else []
    page = graph_payload({**graph, "qParams": {"supernodes": good + supernodes}}, "g.json")
    if not good and case != "twice":
        assert "groups" not in page
        return
    skipped = page["groups"]["skipped"]
    assert len(skipped) == 1 and expected in skipped[0] and expected in page["groups"]["meaning"]
    assert [g["name"] for g in page["groups"]["nodes"]] == (["fine"] if good else ["g"])


def test_a_graph_without_supernodes_has_no_groups(grouped):
    path, _, _ = grouped
    graph = json.loads(path.read_text())
    assert "groups" not in graph_payload({**graph, "qParams": {"supernodes": []}})
    assert "groups" not in graph_payload({k: v for k, v in graph.items() if k != "qParams"})


def test_when_no_group_is_valid_the_note_still_names_each_and_why(grouped):
    path, _, _ = grouped
    graph = json.loads(path.read_text())
    names = _named(graph)
    supernodes = [[names.get(x, x) for x in group] for groups, _ in (SKIPPED["unknown"], SKIPPED["two-layers"])
                  for group in groups]
    page = graph_payload({**graph, "qParams": {"supernodes": supernodes}}, "g.json")
    assert page["groups"]["nodes"] == [] and page["groups"]["links"] == []
    skipped = page["groups"]["skipped"]
    assert len(skipped) == 2 and "group 0 (g): 'nowhere' is no neuron" in skipped[0]
    assert "group 1 (g): neurons of layers" in skipped[1]
    assert all(reason in page["groups"]["meaning"] for reason in skipped)
    assert drawn(page) == (page["nodes"], page["links"])  # every node and link drawn as it is
