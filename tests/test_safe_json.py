"""JSON from outside (``detjac.safe_json``): what Python's parser turns into a RecursionError, an overflow later, or a
non-finite float is one UnreadableJSONError (a DetjacError and a ValueError) whose message completes "Got ..."."""

from __future__ import annotations

import pytest

from detjac.errors import DetjacError
from detjac.safe_json import parse_json


@pytest.mark.parametrize(("text", "got"), [
    ("[" * 100_000 + "]" * 100_000, "values nested too deep to read"),
    ('{"layer": Infinity}', "invalid JSON: Infinity, which standard JSON does not have"),
    ("[NaN]", "invalid JSON: NaN, which standard JSON does not have"),
    ("7" * 5000, "an integer of 5000 digits"),
    ("-" + "7" * 41, "an integer of 41 digits"),
    ("[1e400]", "the number 1e400, which is not finite as a float"),
    ("{", "invalid JSON: Expecting property name"),
    (b"\xff", "invalid JSON: 'utf-8' codec can't decode"),
])
def test_what_no_detjac_file_holds_is_one_error(text, got):
    with pytest.raises(DetjacError, match="^" + got.replace("(", r"\(").replace(")", r"\)")) as caught:
        parse_json(text)
    assert isinstance(caught.value, ValueError)


def test_ordinary_json_reads_as_json():
    assert parse_json('{"a": [1, 2.5, -3, "x", null, true], "b": ' + "9" * 40 + "}") == {
        "a": [1, 2.5, -3, "x", None, True], "b": int("9" * 40)}
