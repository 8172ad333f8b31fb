"""Numbers in text (``detjac.numerals``): ASCII digits written one way only, never a Unicode digit that
``isdigit`` accepts and ``int`` refuses ('²') or reads as another ('٣' as 3)."""

from __future__ import annotations

import pytest

from detjac.numerals import parse_index


@pytest.mark.parametrize(("text", "value"), [("0", 0), ("7", 7), ("123", 123), ("9" * 18, int("9" * 18))])
def test_ascii_digits_read_as_their_number(text, value):
    assert parse_index(text) == value


@pytest.mark.parametrize("text", ["²", "1²", "٣", "３", "", " 1", "1 ", "+1", "-1", "01", "00", "1.0", "1_000",
                                  "9" * 19, None, 3, b"3"])
def test_anything_else_is_no_number(text):
    assert parse_index(text) is None


def test_a_bound_is_exclusive():
    assert parse_index("4", below=5) == 4 and parse_index("5", below=5) is None


def test_an_option_or_key_with_a_unicode_digit_is_refused_by_name(tmp_path):
    from detjac.errors import InvalidArgumentError, StoreFormatError
    from detjac.runs.lens_artifact import _matrices
    from detjac.store.format import Keep

    assert Keep.parse("rank:12").rank == 12
    for text in ("rank:²", "rank:0", "rank:٣"):
        with pytest.raises(InvalidArgumentError, match="Expected --keep full, --keep rank:K"):
            Keep.parse(text)
    with pytest.raises(StoreFormatError, match=r"Expected layer indices .* Got '²'"):
        _matrices({"²": None}, "J", tmp_path / "lens.pt")
