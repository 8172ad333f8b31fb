"""Heads on the graph page, without a browser: a link's head loadings checked (each layer sums to the link's weight),
the heads panel against a graph worked by hand and against an independent dense computation, and the attention files
(`detjac attention --out`) read strictly and tied to their graph's model and prompt (damaged or foreign: refused by
name, never drawn).
"""

from __future__ import annotations

import json
import re
import shlex

import numpy as np
import pytest
from click.testing import CliRunner
from test_graph_drivers import HAND, random_dag
from view_helpers import INJECTED

from detjac.cli.main import main
from detjac.errors import InvalidArgumentError
from detjac.view import GraphFile
from detjac.view.attention_file import TERMS_SHOWN, attention_command, check_belongs, parse_attention
from detjac.view.graph_heads import HEAD_EFFECTS_MEANING, HEADS_MEANING, compact_loadings, parse_loadings
from detjac.view.graph_page import graph_payload


def hand_loaded():
    """HAND (a -> n 2, b -> n -1, n -> L 3, b -> L 1; one layer, two heads) with three links loaded."""
    graph = json.loads(json.dumps(HAND))
    graph["metadata"]["info"]["n_layers"] = 1
    a_n, _, n_l, b_l = graph["links"]
    a_n["head_loadings"] = {"0": {"0": 1.5, "1": -0.5, "skip": 1.0}}
    n_l["head_loadings"] = {}  # a layer-0 neuron into a logit after one layer: no attention layer to cross
    b_l["head_loadings"] = {"0": {"0": 0.25, "1": 0.25, "skip": 0.5}}
    return graph


def test_the_heads_panel_of_a_graph_worked_by_hand():
    page = graph_payload(hand_loaded())
    heads = page["metadata"]["heads"]
    # flows of L: a -> n 0.75 * 2/3 = 0.5, b -> L 1/4, n -> L 3/4. Head 0: 0.5 * 1.5/2 + 0.25 * 0.25/1; head 1:
    # 0.5 * -0.5/2 + 0.25 * 0.25; skip 0.5 * 1/2 + 0.25 * 0.5; covered: 0.5 + 0.25 (n -> L crosses no layer)
    assert [(r["layer"], r["head"]) for r in heads["rows"]] == [(0, 0), (0, 1)]
    assert [r["flow"] for r in heads["rows"]] == pytest.approx([0.4375, -0.0625])
    assert [r["direct"] for r in heads["rows"]] == pytest.approx([0.25, 0.25])  # b -> L's loadings
    assert heads["layers"] == [{"layer": 0, "covered": pytest.approx(0.75), "skip": pytest.approx(0.375)}]
    assert (heads["logit"], heads["loaded"], heads["links"], heads["into_logit"], heads["loaded_into_logit"]) == \
        ("2_9_1", 3, 4, 2, 2)
    assert heads["meaning"] == HEADS_MEANING
    links = page["links"]
    assert links[0]["heads"] == [{"layer": 0, "top": [[0, 1.5], [1, -0.5]], "rest": 0, "n_rest": 0, "skip": 1.0}]
    assert "heads" not in links[1] and links[2]["heads"] == []


def test_the_heads_panel_equals_a_dense_computation_on_random_graphs():
    n, n_heads, n_layers = 60, 5, 5
    s, t, w = random_dag(3, n)
    level = np.random.default_rng(3).integers(0, 6, n)  # random_dag's levels: every link goes up
    rng = np.random.default_rng(4)
    # level 0: tokens; level k: neurons of layer k - 1; 58 and 59 logits (after the last layer)
    nodes = [{"node_id": str(i), "feature_type": "logit" if i in (58, 59) else "embedding" if level[i] == 0
              else "mlp neuron", "layer": str(n_layers + 1) if i in (58, 59) else "E" if level[i] == 0
              else str(level[i] - 1), "ctx_idx": 0, "token_prob": 0.9 if i == 59 else 0.1} for i in range(n)]
    loads = {}
    links = []
    for k, (a, b, x) in enumerate(zip(s, t, w, strict=True)):
        link = {"source": str(a), "target": str(b), "weight": float(x)}
        crossed = range(0 if level[a] == 0 else level[a], n_layers if b in (58, 59) else level[b])
        if k % 2 == 0 and a not in (58, 59) and crossed:  # loadings on the layers the link crosses, as detjac's
            per = np.zeros((n_layers, n_heads))
            per[crossed] = rng.normal(size=(len(crossed), n_heads))
            link["head_loadings"] = {str(layer): {**{str(h): float(v) for h, v in enumerate(per[layer])},
                                                  "skip": float(x - per[layer].sum())} for layer in crossed}
            loads[k] = per
        links.append(link)
    heads = graph_payload({"metadata": {"prompt_tokens": ["a"]}, "nodes": nodes, "links": links})["metadata"]["heads"]
    A = np.zeros((n, n))
    np.add.at(A, (t, s), np.abs(w))
    total = A.sum(1, keepdims=True)
    A /= np.where(total > 0, total, 1.0)
    reach = np.linalg.solve(np.eye(n) - A, np.eye(n))[59]  # sum_{k >= 0} A^k: the flow from logit 59
    expected = np.zeros((n_layers, n_heads))
    for k, per in loads.items():  # a link's own share of its target's |weight| (two links may join the same nodes)
        expected += reach[t[k]] * abs(w[k]) / total[t[k], 0] * per / w[k]
    got = np.zeros((n_layers, n_heads))
    for r in heads["rows"]:
        got[r["layer"], r["head"]] = r["flow"]
    covered = {layer for per in loads.values() for layer in np.flatnonzero(per.any(1))}
    assert np.abs(got - expected).max() < 1e-12 and len(heads["rows"]) == len(covered) * n_heads
    for x in heads["layers"]:  # a layer's heads and skip sum to the flow of its loaded links
        assert expected[x["layer"]].sum() + x["skip"] == pytest.approx(x["covered"], abs=1e-12)
    assert heads["logit"] == "59"


@pytest.mark.parametrize(("loadings", "message"), [
    ({"0": {"0": 1.0, "skip": 1.5}}, "sum to the link's weight"),
    ({"0": {"0": 1.0}}, "heads and 'skip'"),
    ({"0": {"0": "1", "skip": 1.0}}, "finite number"),
    ({"x": {"0": 1.0, "skip": 1.0}}, "layer number"),
    ({"0": {"-1": 1.0, "skip": 1.0}}, "head number"),
    ([1, 2], "object of layers"),
])
def test_damaged_loadings_are_refused_by_name(loadings, message):
    with pytest.raises(InvalidArgumentError, match=message):
        parse_loadings(loadings, 2.0, "the link a -> b of g.json")
    graph = json.loads(json.dumps(HAND))
    graph["links"][0]["head_loadings"] = loadings
    with pytest.raises(InvalidArgumentError, match="E_1_0 -> 0_7_1"):
        graph_payload(graph, "g.json")


def test_a_clicked_links_layers_keep_the_largest_heads_and_still_sum():
    heads = [0.1, -2.0, 0.5, 1.0, -0.2, 0.3]
    layers = parse_loadings({"3": {**{str(h): v for h, v in enumerate(heads)}, "skip": 1.0 - sum(heads)}}, 1.0, "x")
    (shown,) = compact_loadings(layers)
    assert shown["top"] == [[1, -2.0], [3, 1.0], [2, 0.5], [5, 0.3]] and shown["n_rest"] == 2
    assert sum(w for _, w in shown["top"]) + shown["rest"] + shown["skip"] == pytest.approx(1.0)


# -- attention files -----------------------------------------------------------------------------------------------

TOKENS = ["<s>", "a", "b"]


def qk_file(**change):
    """A small attention file as `detjac attention --out` writes it: layer 2, head 1, query 2, components E, A0.1,
    M1 (terms summing to each key's score, probabilities to 1)."""
    comps = ["E", "A0.1", "M1"]
    keys = []
    for j, p in enumerate([0.2, 0.3, 0.5]):
        terms = [{"query": q, "key": k, "value": 0.1 * (j + 1) * (a + 1) - 0.05 * b}
                 for a, q in enumerate(comps) for b, k in enumerate(comps)]
        keys.append({"position": j, "score": sum(x["value"] for x in terms), "probability": p,
                     "terms": sorted(terms, key=lambda x: -abs(x["value"]))})
    data = {"layer": 2, "head": 1, "query_position": 2, "token_ids": [1, 7, 9], "tokens": TOKENS,
            "model": {"family": "Llama", "model_type": "llama", "name_or_path": "", "dtype": "float64",
                      "source": "default", "weights_sha256": "ab" * 32, "n_layers": 4, "n_heads": 4, "d_model": 16},
            "query_token": "b", "residual_error": 1e-16, "score_error": 2e-16, "scaling": 0.125, "softcap": None,
            "neurons": 0, "keys": keys}
    data.update(change)
    return data


def small_graph(**info):
    nodes = [{"node_id": f"E_{i}_{k}", "feature_type": "embedding", "layer": "E", "ctx_idx": k}
             for k, i in enumerate([1, 7, 9])]
    nodes.append({"node_id": "5_3_2", "feature_type": "logit", "layer": "5", "ctx_idx": 2, "token_prob": 0.5,
                  "clerp": 'Output " c" (p=0.500)'})
    return {"metadata": {"prompt_tokens": TOKENS, "info": {"model": "default", "weights_sha256": "ab" * 32,
                                                           "n_layers": 4, **info}},
            "nodes": nodes, "links": [{"source": "E_9_2", "target": "5_3_2", "weight": 1.0}]}


def test_an_attention_file_keeps_each_keys_largest_terms_and_what_the_rest_add_up_to():
    qk = parse_attention(qk_file(), "qk.json")
    assert [k["position"] for k in qk["keys"]] == [0, 1, 2] and qk["query_position"] == 2
    for key, raw in zip(qk["keys"], qk_file()["keys"], strict=True):
        values = sorted((x["value"] for x in raw["terms"]), key=abs, reverse=True)
        assert [v for _, _, v in key["terms"]] == values[:TERMS_SHOWN] and key["n_terms"] == 9
        assert sum(v for _, _, v in key["terms"]) + key["rest"] == pytest.approx(raw["score"])


def damaged(change):
    data = qk_file()
    change(data)
    return data


@pytest.mark.parametrize(("data", "message"), [
    (damaged(lambda d: d["keys"][1]["terms"][0].update(value=9.0)), "sum to its score"),
    (damaged(lambda d: d["keys"][0].update(probability=0.9)), "sum to 1"),
    (damaged(lambda d: d["keys"][0].update(probability=1.5)), "between 0 and 1"),
    (damaged(lambda d: d["keys"][2]["terms"][0].update(query="A2.0")), "below the head's layer 2"),
    (damaged(lambda d: d["keys"][2]["terms"][0].update(key="<b>x</b>")), "Got '<b>x</b>'"),
    (damaged(lambda d: d["keys"][2].update(position=3)), "position to be a non-negative integer below 3"),
    (damaged(lambda d: d["keys"][1].update(position=0)), "once"),
    (damaged(lambda d: d.pop("keys")), "detjac attention --out"),
    (damaged(lambda d: d.update(token_ids=[1, 2])), "same length"),
    (damaged(lambda d: d.update(layer=-1)), "layer to be a non-negative"),
    (damaged(lambda d: d["keys"][0].update(score="1")), "score of key 0 to be a finite number"),
    ([], "detjac attention --out"),
])
def test_a_damaged_attention_file_is_refused_by_name(data, message):
    with pytest.raises(InvalidArgumentError, match=message):
        parse_attention(data, "qk.json")


def test_an_attention_file_of_another_model_or_prompt_is_refused_by_name():
    page = graph_payload(small_graph())
    check_belongs(parse_attention(qk_file(), "qk.json"), page, small_graph()["metadata"]["info"], "qk.json")
    other_prompt = qk_file(tokens=["<s>", "a", "c"])
    with pytest.raises(InvalidArgumentError, match="graph's prompt .* Got one of 3 tokens, '<s>ac'"):
        check_belongs(parse_attention(other_prompt, "qk.json"), page, small_graph()["metadata"]["info"], "qk.json")
    other_ids = qk_file(token_ids=[1, 7, 8])
    with pytest.raises(InvalidArgumentError, match="graph's prompt"):
        check_belongs(parse_attention(other_ids, "qk.json"), page, small_graph()["metadata"]["info"], "qk.json")
    other_weights = qk_file(model={**qk_file()["model"], "weights_sha256": "cd" * 32})
    with pytest.raises(InvalidArgumentError, match="graph's model.*abab.*Got one of weights_sha256 cdcd"):
        check_belongs(parse_attention(other_weights, "qk.json"), page, small_graph()["metadata"]["info"], "qk.json")
    unhashed = {"model": "default", "n_layers": 4}  # no SHA-256 on one side: the model's name decides
    renamed = qk_file(model={**qk_file()["model"], "source": "gpt2"})
    with pytest.raises(InvalidArgumentError, match="model default.*Got one of source gpt2"):
        check_belongs(parse_attention(renamed, "qk.json"), page, unhashed, "qk.json")


def test_a_graph_file_finds_its_attention_files_and_refuses_bad_ones(tmp_path):
    (tmp_path / "g.json").write_text(json.dumps(small_graph()))
    (tmp_path / "g.qk.L2.H1.json").write_text(json.dumps(qk_file()))  # found beside the graph, by name
    other = tmp_path / "elsewhere.json"
    other.write_text(json.dumps(qk_file(head=3)))
    pages = GraphFile(tmp_path / "g.json", [other])
    assert pages.keys() == ["corpus", "graph", "attention/2.1.2", "attention/2.3.2"]
    assert pages.data("attention/2.3.2")["file"] == "elsewhere.json"
    assert pages.data("attention/2.3.2")["graph"] == {  # what the page needs of the graph: never its links
        "nodes": ["E_1_0", "E_7_1", "E_9_2"], "attention": ["attention/2.1.2", "attention/2.3.2"],
        "attention_command": {"prefix": "detjac attention default -p ab", "stem": "g"}}
    assert pages.data("graph")["metadata"]["attention"] == ["attention/2.1.2", "attention/2.3.2"]
    assert pages.data("graph")["metadata"]["attention_command"] == {
        "prefix": "detjac attention default -p ab", "stem": "g"}  # the tokenizer's <s> left out
    twin = tmp_path / "twin.json"
    twin.write_text(json.dumps(qk_file()))
    with pytest.raises(InvalidArgumentError, match="one attention file per head.*twin.json and .*g.qk.L2.H1.json"):
        GraphFile(tmp_path / "g.json", [twin])
    (tmp_path / "g.qk.L0.H0.json").write_text('{"layer": 1e999}')
    with pytest.raises(InvalidArgumentError, match="g.qk.L0.H0.json, which cannot be read as JSON.*not finite"):
        GraphFile(tmp_path / "g.json")
    (tmp_path / "g.qk.L0.H0.json").unlink()
    result = CliRunner().invoke(main, ["view", str(tmp_path / "g.json"), "--attention", str(tmp_path / "nope.json"),
                                       "--export", str(tmp_path / "out")])
    assert result.exit_code != 0 and "nope.json, which cannot be read as JSON" in result.output
    assert not (tmp_path / "out").exists()
    folder = tmp_path / "store"
    folder.mkdir()
    result = CliRunner().invoke(main, ["view", str(folder), "--attention", str(other)])
    assert result.exit_code == 2 and "--attention applies to a graph JSON file" in result.output


def test_the_command_of_a_missing_head_quotes_the_prompt():
    graph = small_graph(model="my model")
    graph["metadata"]["prompt_tokens"] = ["<|begin_of_text|>", INJECTED, " it's"]
    page = graph_payload(graph)
    command = attention_command(page, 3, 1, "g")
    assert shlex.split(command) == ["detjac", "attention", "my model", "-p", INJECTED + " it's", "--layer", "3",
                                    "--head", "1", "--out", "g.qk.L3.H1.json"]


def with_effects(values, targets=("2_9_1",), n_heads=2):
    graph = json.loads(json.dumps(HAND))
    graph["metadata"]["info"].update(n_layers=1, n_heads=n_heads, head_effects={"targets": list(targets),
                                                                                 "values": values})
    return graph


def test_the_heads_panel_lists_every_head_s_direct_effect_largest_first():
    effects = graph_payload(with_effects([[[0.5, -2.0]]]))["metadata"]["heads"]["effects"]
    assert effects == {"targets": ["2_9_1"], "meaning": HEAD_EFFECTS_MEANING,
                       "rows": [{"layer": 0, "head": 1, "effects": [-2.0]}, {"layer": 0, "head": 0, "effects": [0.5]}]}
    assert graph_payload(HAND)["metadata"]["heads"]["effects"] is None  # a graph written without them


@pytest.mark.parametrize(("values", "targets", "got"), [
    ([[[0.5, True]]], ("2_9_1",), "finite numbers"),  # a bool is not a number
    ([[[0.5, float("nan")]]], ("2_9_1",), "finite numbers"),
    ([[[0.5]]], ("2_9_1",), "Got shape (1, 1, 1)"),  # a head of the model missing
    ([[[0.5, 1.0], [1.0, 2.0]]], ("2_9_1",), "Got shape (1, 2, 2)"),  # a layer the model lacks
    ([[[0.5, 1.0]]], ("E_1_0",), "logit node ids of the graph"),  # not a logit
    ([[[0.5, 1.0]], [[1.0]]], ("2_9_1", "2_9_1"), "finite numbers"),  # ragged
])
def test_damaged_direct_effects_are_refused(values, targets, got):
    with pytest.raises(InvalidArgumentError, match=re.escape(got)):
        graph_payload(with_effects(values, targets), "hand.json")
