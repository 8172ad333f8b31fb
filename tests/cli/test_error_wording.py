"""The run's and ``store verify``'s worst reconstruction errors differ (the engine's, before storing, against one
recomputed from the stored arrays): each line says which it is, and each number is what it says."""

from __future__ import annotations

import re

import numpy as np
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.store import open_store


def test_run_and_verify_say_which_reconstruction_error_they_report(tmp_path):
    prompts, out = tmp_path / "p.txt", str(tmp_path / "r.zarr")
    prompts.write_text("The oak tree\n")
    run = CliRunner().invoke(main, ["run", "default", str(prompts), "--out", out])
    assert run.exit_code == 0, run.output
    prompt = open_store(out).get(open_store(out).prompt_ids()[0])
    said = re.search(r"worst reconstruction error this run (\S+) \(\|sum_k J_k x_k - y\| / \|y\| as the engine "
                     r"computed it, before storing\)", run.output)
    assert said and said[1] == f"{prompt.attrs['reconstruction_error']:.2e}", run.output

    verify = CliRunner().invoke(main, ["store", "verify", out])
    said = re.search(r"worst reconstruction error (\S+), recomputed from the stored J, x and y, so it may differ "
                     r"from the run's by rounding", verify.output)
    J = np.asarray(prompt.jacobian(lazy=False), dtype=np.float64)  # (row, token, col)
    x, y = prompt.array("embeddings").astype(np.float64), prompt.array("output").astype(np.float64)
    recomputed = np.linalg.norm(np.einsum("rtc,tc->r", J, x) - y) / np.linalg.norm(y)
    assert verify.exit_code == 0 and said, verify.output
    assert abs(float(said[1]) - recomputed) <= 0.01 * recomputed + 3e-16, (said[1], recomputed)  # summed otherwise
