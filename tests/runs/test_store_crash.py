"""kill -9 of a real `detjac run` at random moments, then the same command again: identical store."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from store_helpers import PROMPTS, assert_same_store, write_prompts

from detjac.store import open_store


def command(prompts, out):
    return [sys.executable, "-m", "detjac.cli.main", "run", "default", str(prompts), "--out", str(out),
            "--row-block", "32"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("crash")
    prompts = write_prompts(folder / "p.txt", PROMPTS)
    started = time.monotonic()
    subprocess.run(command(prompts, folder / "ref.zarr"), check=True, capture_output=True)
    return prompts, folder / "ref.zarr", time.monotonic() - started


def wait_for_prompts(out, count: int, proc, timeout: float = 120.0) -> None:
    """Until ``count`` prompts are visible in ``out`` (the run is then mid-way), or the run ends."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        folder = out / "prompts"
        if folder.is_dir() and sum(1 for _ in folder.iterdir()) - 1 >= count:  # minus prompts/zarr.json
            return
        time.sleep(0.01)


# seed -> prompts to wait for before the kill (-1: kill at a random moment of start-up)
KILL_POINTS = {0: -1, 1: 0, 2: 3, 3: 6}


@pytest.mark.slow
@pytest.mark.parametrize("seed", sorted(KILL_POINTS))
def test_kill_minus_nine_then_resume_gives_the_same_store(reference, tmp_path, seed):
    prompts, ref, duration = reference
    out = tmp_path / "s.zarr"
    rng = random.Random(seed)
    proc = subprocess.Popen(command(prompts, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if KILL_POINTS[seed] < 0:
        time.sleep(rng.uniform(0.2, duration / 2))
    else:
        wait_for_prompts(out, KILL_POINTS[seed], proc)
        time.sleep(rng.uniform(0.0, 0.3))  # somewhere inside the next prompt's row blocks or commit
    assert proc.poll() is None, "the run ended before the kill; the test did not test a crash"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    if (out / "zarr.json").exists():  # whatever is visible after the kill is complete and sound
        visible = open_store(out)
        assert all(r.ok for r in visible.verify()) and len(visible) < len(PROMPTS)
    subprocess.run(command(prompts, out), check=True, capture_output=True)
    assert_same_store(ref, out)  # the same command with the same settings on this machine: the same bits
    assert open_store(out).staging_leftovers() == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".s.zarr.tmp")] == []
    assert len(open_store(out)) == len(PROMPTS)
