"""The CLI runs numpy's OpenBLAS on one thread (its idle threads spin: the small SVDs of `analyze
svd` and `view --export` took 30x the CPU on two), unless the user set OPENBLAS_NUM_THREADS."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import os, detjac.cli.main; print(os.environ['OPENBLAS_NUM_THREADS'])"


@pytest.mark.parametrize(("given", "expected"), [(None, "1"), ("2", "2")])
def test_the_cli_sets_one_blas_thread_unless_told(given: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_numpy_is_not_imported_before_the_cli_sets_it() -> None:
    """The setting is read when numpy loads OpenBLAS: importing the CLI must not load numpy first."""
    code = "import sys, detjac.cli.main; print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
