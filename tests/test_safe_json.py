"""JSON from outside (``detjac.safe_json``): what Python's parser turns into a RecursionError, an overflow later, or a
non-finite float is one UnreadableJSONError (a DetjacError and a ValueError) whose message completes "Got ..."."""

from __future__ import annotations

import pytest
from timed import within

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


@pytest.mark.parametrize("kind", ["graph", "attention", "metadata"])
def test_a_link_to_a_device_or_a_fifo_is_refused_before_reading(tmp_path, kind):
    import os

    from detjac.errors import UnreadableJSONError
    from detjac.safe_json import read_json

    (tmp_path / "zero.json").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "folder.json").mkdir()
    for name, got in (("zero.json", "a character device, not a regular file"),
                      ("fifo.json", "a FIFO (named pipe), not a regular file"),
                      ("folder.json", "a folder, not a regular file")):
        out = within(5, lambda name=name: read_json(tmp_path / name, kind=kind))
        assert isinstance(out.get("error"), UnreadableJSONError) and str(out["error"]) == got, out


def test_a_file_over_its_kind_s_cap_is_refused_before_reading(tmp_path, monkeypatch):
    from detjac import safe_json
    from detjac.errors import UnreadableJSONError

    big = tmp_path / "big.json"
    with open(big, "wb") as handle:  # sparse: nothing written but its size
        handle.truncate(safe_json.METADATA_MAX_BYTES + 1)
    with pytest.raises(UnreadableJSONError,
                       match=r"^a file of 67,108,865 bytes, more than the 64 MiB a metadata file may hold$"):
        safe_json.read_json(big)
    monkeypatch.setattr(safe_json, "os", _ReadCounter(safe_json.os))
    with pytest.raises(UnreadableJSONError, match="more than the 64 MiB"):
        safe_json.read_json(big)
    assert safe_json.os.read_bytes == 0  # refused on the open file's size, not after reading it


def test_a_file_that_reports_no_size_is_read_up_to_its_cap_only(monkeypatch):
    from detjac import safe_json
    from detjac.errors import UnreadableJSONError

    monkeypatch.setitem(safe_json.MAX_BYTES, "metadata", 100)
    monkeypatch.setattr(safe_json, "os", _ReadCounter(safe_json.os))
    with pytest.raises(UnreadableJSONError, match="^a file that grew past the 100 bytes a metadata file may hold"):
        safe_json.read_json("/proc/self/status")  # size 0 as stat reports it, about 1 kB as read
    assert safe_json.os.read_bytes == 101


def test_a_regular_file_through_a_link_reads_as_json(tmp_path):
    from detjac.safe_json import read_json

    (tmp_path / "real.json").write_text('{"a": [1, 2]}')
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert read_json(tmp_path / "link.json") == read_json(tmp_path / "real.json", kind="graph") == {"a": [1, 2]}


class _ReadCounter:
    """``os`` with its ``read`` counted."""

    def __init__(self, real):
        self.real, self.read_bytes = real, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def read(self, fd, n):
        data = self.real.read(fd, n)
        self.read_bytes += len(data)
        return data
