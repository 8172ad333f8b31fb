"""The attention page's sums: each key's query-side and key-side sums, read from a ``detjac attention`` file whether
or not it records them (a file written before they were recorded gets them from its terms), each adding up to the
score; recorded sums that are not the terms' own are refused by name."""

from __future__ import annotations

import math

import pytest
from test_graph_heads import qk_file

from detjac.errors import InvalidArgumentError
from detjac.view.attention_file import parse_attention


def grouped(terms, side):
    out = {}
    for t in terms:
        out[t[side]] = out.get(t[side], 0.0) + t["value"]
    return out


def recorded(data):
    """``data`` with each key's sums recorded as `detjac attention` writes them."""
    for key in data["keys"]:
        for name, side in (("query_sums", "query"), ("key_sums", "key")):
            sums = grouped(key["terms"], side)
            key[name] = [{"component": c, "value": v} for c, v in sorted(sums.items(), key=lambda x: -abs(x[1]))]
    return data


@pytest.mark.parametrize("data", [qk_file(), recorded(qk_file())], ids=["written before", "recorded"])
def test_each_key_gets_every_component_s_sum_on_each_side_adding_up_to_its_score(data):
    qk = parse_attention(data, "qk.json")
    for key, raw in zip(qk["keys"], qk_file()["keys"], strict=True):
        for name, side in (("query_sums", "query"), ("key_sums", "key")):
            want = grouped(raw["terms"], side)
            assert [c for c, _ in key[name]] == sorted(want, key=lambda c: (-abs(want[c]), c))
            assert all(v == pytest.approx(want[c], abs=1e-15) for c, v in key[name])
            assert math.fsum(v for _, v in key[name]) == pytest.approx(raw["score"], abs=1e-14)


def edited(change):
    data = recorded(qk_file())
    change(data["keys"][1])
    return data


@pytest.mark.parametrize("data", [
    edited(lambda k: k["query_sums"][0].update(value=k["query_sums"][0]["value"] + 1e-6)),
    edited(lambda k: k["key_sums"].pop()),
    edited(lambda k: k["key_sums"].append({"component": "M0", "value": 0.0})),
    edited(lambda k: k["query_sums"][1].update(component="A0.2")),
    edited(lambda k: k["query_sums"][1].update(value="0.1")),
    edited(lambda k: k.update(key_sums={"E": 1.0})),
])
def test_recorded_sums_that_are_not_the_terms_own_are_refused_by_name(data):
    with pytest.raises(InvalidArgumentError, match=r"^Expected the (query|key)_sums of each key to be its terms summed "
                                                   r"per component in qk\.json\. Got .* at key 1: the file is damaged"):
        parse_attention(data, "qk.json")
