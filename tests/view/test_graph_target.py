"""The target panel's data (torch-free): each logit node's token contributions with their sum, the set-aside
positions, and damaged contributions refused by name."""

from __future__ import annotations

import pytest

from detjac.errors import InvalidArgumentError
from detjac.view.graph_target import ASIDE_MEANING, target_panel

TOKENS = ["<s>", "The", " cat"]
LOGITS = {"4_9_2": 'Output " sat" − " ran" (p=0.300)'}


def _info(**changes):
    made = {"targets": ["4_9_2"], "values": [[0.0, 0.25, -1.5]], "constants": [0.125], "target_values": [-1.125]}
    return {"target": "' sat' - ' ran'", "aside": [0], "token_contributions": {**made, **changes}}


def test_the_panel_lists_each_tokens_contribution_and_their_sum():
    panel = target_panel(_info(), TOKENS, LOGITS, "g.json")
    assert panel["text"] == "' sat' - ' ran'" and panel["aside"] == [0] and panel["aside_meaning"] == ASIDE_MEANING
    (t,) = panel["targets"]
    assert t["tokens"] == [[0, "<s>", 0.0], [1, "The", 0.25], [2, " cat", -1.5]]
    assert t["sum"] == -1.125 == t["value"] and t["label"] == LOGITS["4_9_2"]
    assert target_panel({}, TOKENS, LOGITS, "g.json") is None  # a graph written without contributions


@pytest.mark.parametrize("changes", [{"values": [[0.0, 0.25]]}, {"values": [[0.0, "1", 2.0]]},
                                     {"targets": ["nope"]}, {"constants": []}, {"values": [[0.0, float("nan"), 1]]}])
def test_damaged_contributions_are_refused(changes):
    with pytest.raises(InvalidArgumentError, match="token_contributions of g.json"):
        target_panel(_info(**changes), TOKENS, LOGITS, "g.json")


def test_bad_aside_positions_are_refused():
    with pytest.raises(InvalidArgumentError, match="aside of g.json"):
        target_panel({**_info(), "aside": [7]}, TOKENS, LOGITS, "g.json")
