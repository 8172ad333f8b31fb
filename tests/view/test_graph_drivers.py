"""The graph page's "what drives it": driver shares against a graph worked by hand and against the dense series
``sum_k A^k`` (an independent computation), the budget's order, and what the page gets (logit tokens, the meanings of
the kept share and of the drivers)."""

from __future__ import annotations

import numpy as np
import pytest

from detjac.errors import InvalidArgumentError
from detjac.graph_settings import KEPT_SHARE_MEANING
from detjac.view.graph_drivers import DRIVERS_MEANING, driver_shares, node_drivers
from detjac.view.graph_page import graph_payload


def node(node_id, kind, layer, ctx, influence=None, clerp=""):
    return {"node_id": node_id, "feature_type": kind, "layer": layer, "ctx_idx": ctx, "influence": influence,
            "clerp": clerp}


# tokens a (0) and b (1); neuron n (layer 0): 2 from a, -1 from b; logit L: 3 from n, 1 from b
HAND = {"metadata": {"prompt_tokens": ["a", "b"], "info": {"logit_share_kept": [0.5]}},
        "nodes": [node("E_1_0", "embedding", "E", 0), node("E_2_1", "embedding", "E", 1),
                  node("0_7_1", "mlp neuron", "0", 1, 0.4), node("2_9_1", "logit", "2", 1, 0.1,
                                                                'Output " "Par"is" (p=0.773)')],
        "links": [{"source": "E_1_0", "target": "0_7_1", "weight": 2.0},
                  {"source": "E_2_1", "target": "0_7_1", "weight": -1.0},
                  {"source": "0_7_1", "target": "2_9_1", "weight": 3.0},
                  {"source": "E_2_1", "target": "2_9_1", "weight": 1.0}]}


def test_driver_shares_of_a_graph_worked_by_hand():
    page = graph_payload(HAND)
    logit = page["nodes"][3]
    # L: 3/4 of its |weight| from n, 1/4 from b; n: 2/3 from a, 1/3 from b. Through n: a 3/4 * 2/3, b 1/4 + 3/4 * 1/3
    assert dict(map(tuple, logit["drivers"])) == pytest.approx({2: 0.75, 0: 0.5, 1: 0.5})
    assert [i for i, _ in logit["drivers"]] == [2, 0, 1]  # largest share first
    assert dict(map(tuple, page["nodes"][2]["drivers"])) == pytest.approx({0: 2 / 3, 1: 1 / 3})
    assert page["nodes"][0]["drivers"] is None  # a token: nothing upstream
    assert logit["token"] == ' "Par"is' and page["nodes"][2]["token"] is None  # quotes inside the token kept
    assert page["metadata"]["kept_share"] == KEPT_SHARE_MEANING
    assert page["metadata"]["drivers"] == {"k": 12, "computed": 2, "meaning": DRIVERS_MEANING}


def random_dag(seed, n=60, m=600):
    rng = np.random.default_rng(seed)
    layer = rng.integers(0, 6, n)
    s, t = rng.integers(0, n, m), rng.integers(0, n, m)
    keep = layer[s] < layer[t]
    return s[keep], t[keep], rng.normal(size=int(keep.sum()))


@pytest.mark.parametrize("seed", [0, 1])
def test_driver_shares_equal_the_series_of_the_normalised_adjacency(seed):
    n = 60
    s, t, w = random_dag(seed, n)
    A = np.zeros((n, n))
    np.add.at(A, (t, s), np.abs(w))
    total = A.sum(1, keepdims=True)
    A /= np.where(total > 0, total, 1.0)
    series = np.linalg.solve(np.eye(n) - A, A)  # sum_{k >= 1} A^k: A is nilpotent on a DAG
    wanted = np.arange(n)
    assert np.abs(driver_shares(n, s, t, w, wanted) - series).max() < 1e-12
    roots = np.bincount(t, minlength=n) == 0  # every path starts at a node without incoming links
    reached = total[:, 0] > 0
    assert series[np.ix_(reached, roots)].sum(1) == pytest.approx(np.ones(reached.sum()))


def test_the_budget_serves_logits_first_then_the_most_influential():
    s, t, w = random_dag(2, n=40, m=400)
    kinds = ["logit" if i >= 36 else "mlp neuron" for i in range(40)]
    nodes = [{"id": str(i), "type": kinds[i], "influence": i / 40} for i in range(40)]
    links = [{"source": str(a), "target": str(b), "weight": float(x)} for a, b, x in zip(s, t, w, strict=True)]
    drivers, computed = node_drivers(nodes, links, work=6 * (40 + len(links)))  # targets x (nodes + links)
    upstream = set(t.tolist())
    done = [i for i, d in enumerate(drivers) if d is not None]
    assert computed == len(done) == 6
    expected = sorted(i for i in upstream if kinds[i] == "logit") + \
        sorted(i for i in upstream if kinds[i] != "logit")[:6 - sum(kinds[i] == "logit" for i in upstream)]
    assert sorted(done) == sorted(expected)
    assert all(len(d) <= 12 and all(share > 0 for _, share in d) for d in drivers if d is not None)


def test_a_cycle_is_refused():
    cyclic = {**HAND, "links": [*HAND["links"], {"source": "2_9_1", "target": "0_7_1", "weight": 1.0}]}
    with pytest.raises(InvalidArgumentError, match="without cycles"):
        graph_payload(cyclic)
