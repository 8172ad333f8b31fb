"""A mistyped MODEL, prompts file, ``--out`` or ``--max-memory`` is refused as the command line is
parsed, before torch or transformers is imported (it took 4-16 s, their import time, to say so); ``view`` of a file
that is neither a store nor a graph JSON names both."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from click.testing import CliRunner
from detjac.cli.main import main
for args in {cases!r}:
    result = CliRunner().invoke(main, args)
    print(result.exit_code, result.output.strip().splitlines()[-1])
print("heavy:", sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_bad_paths_and_budgets_are_refused_before_torch_is_imported(tmp_path):
    missing = str(tmp_path / "missing")
    cases = [["jacobian", missing, "-p", "x"],
             ["svd", missing + ".ggfu", "-p", "x"],
             ["graph", missing + ".gguf", "-p", "x", "--out", str(tmp_path / "g.json")],
             ["jacobian", "-p", "x", "--max-memory", "4GB"],
             ["run", "default", missing + ".txt", "--out", str(tmp_path / "s.zarr")],
             ["lens", "apply", "x.lens", "-p", "x", "--model", missing],
             ["view", str(tmp_path / "blank.txt")],
             ["graph", "-p", "x", "--out", str(tmp_path / "g.txt")],
             ["jacobian", "-p", "x", "--out", missing + "/x.npz"]]
    (tmp_path / "blank.txt").write_text("\n")
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(cases=cases)], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == ("1 Error: Expected a Hugging Face checkpoint directory or a hub id (org/name). "
                      f"Got {missing!r}, which does not exist.")
    assert "which does not exist (a GGUF file's name ends in .gguf)" in out[1]
    assert out[2] == f"1 Error: Expected a GGUF file at {missing}.gguf. Got no such file."
    assert out[3] == "1 Error: Expected --max-memory as DEVICE=SIZE[,DEVICE=SIZE] (e.g. cuda:0=8GiB,cpu=32GiB). " \
                     "Got '4GB'."
    assert out[4] == f"1 Error: Expected a prompts file at {missing}.txt. Got no such file."
    assert out[5].startswith("1 Error: Expected a Hugging Face checkpoint directory") and missing in out[5]
    assert out[6] == (f"1 Error: Expected a detjac store (a folder) or a graph JSON file (*.json, from `detjac graph`) "
                      f"at {tmp_path / 'blank.txt'}. Got a file of neither kind.")
    assert out[7] == f"2 Error: Invalid value for '--out' / '-o': Expected a path ending in .json. Got " \
                     f"{str(tmp_path / 'g.txt')!r}."
    assert out[8] == f"1 Error: Expected an existing folder for {missing}/x.npz. Got none at {missing}."
    assert out[9] == "heavy: []", out
    assert not (tmp_path / "s.zarr").exists() and not (tmp_path / "g.json").exists()
