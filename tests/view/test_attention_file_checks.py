"""Attention (QK) files and head loadings read strictly: a planted file beside a graph (a link to a device, a FIFO)
refused at once in one line, a file's model identity complete and its head one the model has, and head loadings only
on the layers a link crosses, complete there (damaged stored loadings raise, never read as "no layer crossed")."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from test_graph_heads import small_graph
from timed import within

from detjac.cli.main import main
from detjac.errors import InvalidArgumentError
from detjac.view import GraphFile


@pytest.mark.parametrize("plant", ["device", "fifo"])
def test_a_planted_attention_file_is_refused_at_once_in_one_line(tmp_path, plant):
    (tmp_path / "g.json").write_text(json.dumps(small_graph()))
    planted = tmp_path / "g.qk.L2.H1.json"
    if plant == "device":
        planted.symlink_to("/dev/zero")
    else:
        os.mkfifo(planted)
    got = "a character device, not a regular file" if plant == "device" else "a FIFO (named pipe), not a regular file"
    out = within(10, lambda: GraphFile(tmp_path / "g.json"))
    assert isinstance(out.get("error"), InvalidArgumentError), out
    assert f"Got {planted}, which cannot be read as JSON ({got})" in str(out["error"])
    result = within(10, lambda: CliRunner().invoke(main, ["view", str(tmp_path / "g.json"), "--export",
                                                          str(tmp_path / "out")]))["value"]
    assert result.exit_code == 1 and got in result.output and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    planted.unlink()
    result = within(10, lambda: CliRunner().invoke(main, ["view", str(tmp_path / "g.json"), "--attention",
                                                          "/dev/zero", "--export", str(tmp_path / "out")]))["value"]
    assert result.exit_code == 1 and "Got /dev/zero, which cannot be read as JSON (a character device" in \
        result.output and not (tmp_path / "out").exists(), result.output
