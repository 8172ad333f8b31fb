"""``python -m benchmarks.gpu_check --dry-run``: the prepared GPU call runs its every step on the CPU at tiny shapes, so
it cannot rot before a GPU is lent; its JSON holds what the GPU run will fill, and its figures are right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import STEPS

ROOT = Path(__file__).resolve().parent.parent
GPU_CHECK = [sys.executable, "-m", "benchmarks.gpu_check"]  # run from the repository root (cwd=ROOT)


def script_steps() -> list[str]:
    """The step names of the script's ``STEPS`` table, in order."""
    return [name for name, _ in STEPS]


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out, tmp = tmp_path_factory.mktemp("gpu"), tmp_path_factory.mktemp("checkpoints")
    got = subprocess.run([*GPU_CHECK, "--dry-run", "--out", str(out), "--tmp", str(tmp)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-4000:]
    return out, json.loads((out / "gpu.json").read_text()), got.stdout


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_says_how_far_it_got(dry):
    out, report, stdout = dry
    assert report["dry_run"] is True and report["device"] == "cpu"
    steps = script_steps()
    assert list(report["steps"]) == steps
    assert {s["status"] for s in report["steps"].values()} == {"done"}, report["steps"]
    log = (out / "gpu.log").read_text()
    for name in steps:
        assert f"{name}: done" in stdout
    assert "exactness llama: float64" in log  # the worker's progress reaches the log, timestamped
    assert set(report["goals"]) == {"70b_peak_gpu_le_8gib", "70b_16_tokens_float32_le_120s",
                                    "70b_16_tokens_float64_le_300s", "8b_share_of_matmul_ge_0.5",
                                    "svd_1024_tokens_le_300s", "graph_heads_device_equals_cpu_float64"}
    assert report["goals"]["graph_heads_device_equals_cpu_float64"]["met"]


@pytest.mark.slow
def test_the_dry_run_figures_are_right(dry):
    _, report, _ = dry
    steps = {name: s["result"] for name, s in report["steps"].items()}
    assert steps["exactness"]["all_exact"] and len(steps["exactness"]["models"]) == 7
    for row in steps["exactness"]["models"].values():
        assert row["float32"]["rel_error_vs_cpu_float64"] < 1e-4
    for name in ("8b-16-f64", "70b-16-f64", "8b-64-f64"):
        assert steps[name]["reconstruction_error"] < 1e-12, name
    for name in ("8b-16-f32", "70b-16-f32", "8b-64-f32", "q4-16-f32"):
        assert steps[name]["reconstruction_error"] < 1e-5, name
    for name, r in steps.items():
        if "jacobian_s" in r:  # the budget ladder: the too-small budget refused with the engine's reason
            assert r["row_blocks"] >= 2 and len(r["seconds_per_block"]) == r["row_blocks"], name
            assert "Expected a memory budget" in r["refused_budgets"][0]["refused"]
    assert "extrapolated_80_layers" in steps["70b-16-f32"] and "extrapolated_80_layers" in steps["q4-16-f32"]
    graph = steps["graph-heads"]  # the device's graph (here the CPU's again) against the CPU's, made in the run
    assert graph["agreement"]["equal_within_float64"] and graph["agreement"]["same_nodes_and_links"]
    for side in ("device", "cpu"):
        assert graph[side]["completeness"] < 1e-12 and graph[side]["head_loadings_error"] < 1e-12
        assert graph[side]["links_loaded"] == graph["graph"]["heads"]
    assert steps["svd-1024"]["converged"] and steps["svd-1024"]["max_residual"] < 1e-4
    assert steps["reference"]["runs"][0]["rel_diff_vs_detjac"] < 1e-5  # the paper's method gives the same J
    assert steps["cli"]["returncode"] == 0 and steps["cli"]["store_gib"] > 0


@pytest.mark.slow
def test_a_step_cut_short_is_killed_and_the_next_runs_in_a_new_worker(tmp_path):
    """A step past its time is killed (its worker with it) and marked cut_short, keeping what it wrote; the next
    step starts a new worker; gpu.json stays complete JSON."""
    got = subprocess.run([*GPU_CHECK, "--dry-run", "--out", str(tmp_path), "--tmp",
                          str(tmp_path / "ckpt"), "--only", "machine,exactness,checkpoint-8b",
                          "--step-timeout-s", "exactness=0.5"],  # seven models cannot be done in half a second
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    report = json.loads((tmp_path / "gpu.json").read_text())
    steps = report["steps"]
    assert steps["machine"]["status"] == "done", got.stdout[-3000:]
    assert steps["exactness"]["status"] == "cut_short" and steps["exactness"]["seconds"] < 10
    assert steps["checkpoint-8b"]["status"] == "done" and steps["checkpoint-8b"]["result"]["gib"] > 0


def test_steps_with_no_time_left_are_skipped_saying_so(tmp_path):
    got = subprocess.run([*GPU_CHECK, "--dry-run", "--out", str(tmp_path), "--budget-s", "10"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert got.returncode == 0, got.stderr
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert {s["status"] for s in report["steps"].values()} == {"skipped"}
    assert "left of the 10 s budget" in report["steps"]["machine"]["why"]
    assert report["goals"]["svd_1024_tokens_le_300s"] is None  # nothing measured, nothing judged


def test_unknown_steps_are_refused_naming_the_known_ones(tmp_path):
    got = subprocess.run([*GPU_CHECK, "--dry-run", "--out", str(tmp_path), "--only", "gpu"],
                         capture_output=True, text=True, cwd=ROOT)
    assert got.returncode == 2 and "expected steps among machine, exactness" in got.stderr


def test_the_user_guide_shows_the_planners_table_as_printed():
    """docs/user-guide.md's budget table is what ``gpu_check.py --plans`` prints (the engine's own cost model)."""
    got = subprocess.run([*GPU_CHECK, "--plans"], capture_output=True, text=True, check=True, cwd=ROOT)
    page = (ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8")
    assert got.stdout.strip() in page, ("run python -m benchmarks.gpu_check --plans and paste its table into the "
                                        "GPU section")
    # the layers counted as stored (two) plus the one in use widened, a matrix at a time (†) where the budget needs
    # it: 70B in float32 and float64 fits 8 GiB from bf16 weights
    assert "| Llama-3.3-70B | bf16 | float32 | 16 | 1.59 / 3.19 | refused | 8 × 1024 † |" in got.stdout
    assert "| Llama-3.3-70B | bf16 | float64 | 16 | 1.59 / 6.38 | refused | 47 × 175 † |" in got.stdout


def test_exactness_float64_and_the_reference_come_before_the_svd():
    """What a short run must not miss comes first: a run cut at the SVD has measured them."""
    from benchmarks.gpu_check import BUDGET_S

    names = script_steps()
    before = names[:names.index("svd-1024")]
    for name in ("exactness", "graph-heads", "8b-16-f64", "70b-16-f64", "reference", "q4-16-f32"):
        assert name in before, name
    assert BUDGET_S == 300  # two runs and the machine's start within a lent machine's 15 minutes


def _graph(neurons, adjacency, loadings, links=((0, 1),)):
    from types import SimpleNamespace

    import numpy as np

    return SimpleNamespace(neurons=np.asarray(neurons), logit_ids=[7], adjacency=np.asarray(adjacency),
                           activations=np.ones(len(neurons)),
                           head_loadings=SimpleNamespace(links=np.asarray(links), loadings=np.asarray(loadings)))


def test_the_graph_comparison_accepts_rounding_and_refuses_more():
    """Two graphs agree within float64 rounding of their largest entries, with NaNs in the same places; a larger
    difference, a NaN moved, or other nodes are refused."""
    from benchmarks.support.gpu_graph import compare_graphs

    nan = float("nan")
    want = _graph([[0, 1, 2]], [[0.0, 2.0], [1.0, 0.0]], [[[1.0, nan]]])
    assert compare_graphs(_graph([[0, 1, 2]], [[0.0, 2.0 + 4e-16], [1.0, 0.0]], [[[1.0, nan]]]),
                          want)["equal_within_float64"]
    wider = compare_graphs(_graph([[0, 1, 2]], [[0.0, 2.0], [1.0 + 1e-9, 0.0]], [[[1.0, nan]]]), want)
    assert not wider["equal_within_float64"] and 4e-10 < wider["adjacency"] < 6e-10  # relative to the largest, 2
    moved = compare_graphs(_graph([[0, 1, 2]], [[0.0, 2.0], [1.0, 0.0]], [[[nan, 1.0]]]), want)
    assert not moved["nan_places_equal"] and not moved["equal_within_float64"]
    other = compare_graphs(_graph([[0, 1, 3]], [[0.0, 2.0], [1.0, 0.0]], [[[1.0, nan]]]), want)
    assert other == {"same_nodes_and_links": False, "equal_within_float64": False}
