"""The attention-sink flag of decoded right singular vectors (detjac.sinks): the rule, and a print site saying it."""

from __future__ import annotations

import pytest

from detjac.sinks import SINK_NOTE, SINK_SHARE, sink_note


@pytest.mark.parametrize(("position", "share", "combined", "flagged"), [
    (0, 0.98, True, True), (0, SINK_SHARE, True, True), (0, 0.89, True, False),  # the threshold, inclusive
    (1, 0.99, True, False),  # most of |v|^2 on another token: not the first one
    (0, 1.0, False, False),  # a per-token operator's vector: share 1 by construction
])
def test_the_rule(position, share, combined, flagged):
    assert sink_note(position, share, combined) == (SINK_NOTE if flagged else None)


def test_analyze_decodes_print_names_the_sink(capsys):
    from detjac.analysis.decoded import DecodedSpectrum, DecodedTriplet
    from detjac.cli.render import echo_decoded

    triplets = [DecodedTriplet(1, 3.0, "' Paris'", "' implement' ' attendance'", 0, 0.98),
                DecodedTriplet(2, 2.0, "' the'", "' capital'", 3, 0.95),
                DecodedTriplet(3, 1.0, "' a'", "' of'", 0, 0.60)]
    echo_decoded([DecodedSpectrum("p", "p 'The capital of France is'", "output", "[J_1 ... J_n]", None, triplets),
                  DecodedSpectrum("p", "p", "output", "J_0", 0, [DecodedTriplet(1, 3.0, "'a'", "'b'", 0, 1.0)])])
    lines = [line for line in capsys.readouterr().out.splitlines() if "right [" in line]
    assert lines[0] == f"     right [token 0, 98%; {SINK_NOTE}] -> ' implement' ' attendance'"
    assert [SINK_NOTE in line for line in lines] == [True, False, False, False]


def test_the_demos_lines_name_the_sink_on_the_combined_operator_only():
    import torch

    from detjac.engine.tools.triplets import DecodedOperator, _operator_lines

    ids = torch.tensor([[1, 2], [3, 4]])
    combined = DecodedOperator("combined", None, torch.tensor([3.0, 2.0]), ids, ids.double(), ids, ids.double(),
                               [0, 1], [0.97, 0.99])
    lines = _operator_lines(combined, None, ["'The'", "' bridge'"], "  ")
    assert lines[1].strip().startswith(f"right [at 'The', 97% of |v|^2; {SINK_NOTE}] -> ")
    assert SINK_NOTE not in lines[3]  # 99 %, but on another token
    first = DecodedOperator("'The'", 0, torch.tensor([3.0, 2.0]), ids, ids.double(), ids, ids.double(), [0, 0],
                            [1.0, 1.0])
    assert not any(SINK_NOTE in line for line in _operator_lines(first, None, ["'The'", "' bridge'"], "  "))
