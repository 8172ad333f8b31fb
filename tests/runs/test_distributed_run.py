"""`detjac run` on a dask.distributed LocalCluster of 2 worker processes (loopback only): the same store as a
run in one process, a worker killed mid-prompt, Ctrl-C, prompts that fail, a second run refused.

The workers run one thread each and the reference run in this process runs torch's default thread count, so their
GEMMs may round differently: stores are compared within float64 rounding (``assert_equivalent_store``), never bit for
bit, and one test forces another rounding on the workers to show the comparison holds when the bits do differ."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from store_helpers import PROMPTS, assert_equivalent_store, run_default, write_prompts

from detjac.cli.main import main
from detjac.errors import StoreError
from detjac.store import open_store

CORPUS = PROMPTS[:4]


@pytest.fixture(scope="module")
def cluster():
    """A LocalCluster of 2 worker processes with one thread each, shared by the tests that use --scheduler.
    Workers import torch and the engine as they start (a replaced worker too), so no test waits for that."""
    import dask
    from distributed import Client, LocalCluster

    from detjac.runs.scheduler import LOST_WORKER_TIMEOUT

    with dask.config.set({"distributed.deploy.lost-worker-timeout": LOST_WORKER_TIMEOUT}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
                         preload=["detjac.runs.cluster", "detjac.engine"]) as lc, Client(lc) as client:
        yield lc.scheduler_address, client


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The corpus written by a run in one process."""
    folder = tmp_path_factory.mktemp("single")
    return run_default(folder, CORPUS, "ref.zarr").path


def test_scheduler_run_equals_the_single_process_store(tmp_path, reference, cluster):
    address, _ = cluster
    prompts = write_prompts(tmp_path / "p.txt", CORPUS)
    out = tmp_path / "s.zarr"
    result = CliRunner().invoke(main, ["run", "default", str(prompts), "--out", out.as_uri(), "--scheduler", address])
    assert result.exit_code == 0, result.output
    assert f"dask scheduler {address} (2 workers), dashboard" in result.output
    assert "done: 4 written, 0 already complete, 0 failed" in result.output
    assert re.search(r"model loads: [12] workers?, 1 each", result.output)  # one load per worker, not per prompt
    assert_equivalent_store(reference, out)
    assert open_store(out).staging_leftovers() == [] and open_store(out).failures() == {}
    lock = json.loads((out / "_writer" / "zarr.json").read_text())
    assert lock == {"zarr_format": 3, "node_type": "group", "attributes": {}}  # the holder record goes with the run


def _gemm_bits() -> str:
    """A digest of one fixed float64 GEMM's bits in this process, on one thread (as the workers run)."""
    import hashlib

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.arange(96 * 160, dtype=torch.float64).reshape(96, 160).sin()
        return hashlib.sha256((a @ a.T.cos()).numpy().tobytes()).hexdigest()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_run_on_workers_that_round_differently_still_equals_the_single_process_store(tmp_path, reference):
    """On CPUs where one and two threads happen to round alike the comparison above sees the same bits; here the
    workers are forced onto MKL's other GEMM code path (MKL_CBWR in their environment only), so the stores differ in
    the last bits for certain, and must still agree within float64 rounding."""
    import torch
    from distributed import Client, LocalCluster

    if not torch.backends.mkl.is_available():
        pytest.skip("this PyTorch has no MKL, so MKL_CBWR cannot force another rounding on the workers")
    forced = "AUTO" if os.environ.get("MKL_CBWR", "").upper().startswith("COMPATIBLE") else "COMPATIBLE"
    out = tmp_path / "s.zarr"
    prompts = write_prompts(tmp_path / "p.txt", CORPUS)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0",
                      env={"MKL_CBWR": forced}) as lc, Client(lc) as client:
        gemm = client.run(lambda: __import__("os").environ.get("MKL_CBWR"))
        assert set(gemm.values()) == {forced} and os.environ.get("MKL_CBWR") != forced
        worker_bits = set(client.run(_gemm_bits).values())
        assert worker_bits and _gemm_bits() not in worker_bits, "the workers' GEMMs round as this process's do"
        result = CliRunner().invoke(main, ["run", "default", str(prompts), "--out", str(out), "--scheduler",
                                           lc.scheduler_address])
    assert result.exit_code == 0, result.output
    seen = assert_equivalent_store(reference, out)
    assert any(name.endswith("/jacobian") for name in seen.differing), "no Jacobian differed in its bits"
    assert 0 < seen.largest_relative <= 1e-12


def _attempts(out):
    staging = out / "_staging"
    return [p for p in staging.iterdir() if p.name != "zarr.json"] if staging.is_dir() else []


def test_a_worker_killed_mid_prompt_leaves_a_complete_identical_store(tmp_path, reference, cluster):
    from concurrent.futures import ThreadPoolExecutor

    from detjac.engine import ModelRef
    from detjac.model_settings import LoadSpec
    from detjac.runs.cluster import run_on_cluster
    from detjac.runs.plan import open_run_store, prepare_run

    _, client = cluster
    out = tmp_path / "s.zarr"
    spec = LoadSpec(model=ModelRef.resolve("default"))
    plan = prepare_run("default", write_prompts(tmp_path / "p.txt", CORPUS), spec, row_block=None,
                       max_tokens=None, keep="full", lenient=True)
    pids = set(client.run(os.getpid).values())
    summary = plan.summary()
    with open_run_store(plan, out) as store, ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_on_cluster, client, plan, store, plan.pending(store, summary), summary,
                              progress=False)
        deadline, victim = time.monotonic() + 120, None
        while victim is None and not running.done() and time.monotonic() < deadline:
            # an attempt's staging folder is <prompt id>.<host>.<pid>.<random>: a worker in the middle of a prompt
            victim = next((a for a in _attempts(out) if int(a.name.split(".")[-2]) in pids), None)
            time.sleep(0.005)
        assert victim is not None and not running.done(), "no prompt was seen in progress; nothing was tested"
        os.kill(int(victim.name.split(".")[-2]), signal.SIGKILL)
        time.sleep(0.2)
        assert victim.exists(), "the attempt committed before the kill; no prompt in progress was killed"
        running.result(timeout=180)
    assert summary.written == len(CORPUS) and summary.failed == {}
    assert all(n == 1 for n, _ in summary.loads.values())
    assert_equivalent_store(reference, out)
    assert open_store(out).staging_leftovers() == []  # the killed attempt's files are gone
    client.wait_for_workers(2, timeout=60)  # the nanny replaced the killed worker


def test_local_cluster_run_records_deterministic_failures_and_runs_the_others(tmp_path, cluster):
    lines = [json.dumps({"prompt": PROMPTS[0]}), json.dumps({"prompt": ""}),
             json.dumps({"prompt": PROMPTS[1] + " It is a strong tree with hard wood and acorns.", "id": 7}),
             json.dumps({"prompt": PROMPTS[2]})]
    prompts = write_prompts(tmp_path / "p.jsonl", lines)
    out = tmp_path / "s.zarr"
    args = ["run", "default", str(prompts), "--out", str(out), "--max-tokens", "20"]
    result = CliRunner().invoke(main, [*args, "--workers", "2"])
    assert result.exit_code == 3, result.output
    assert "dask LocalCluster: 2 workers" in result.output and "dashboard http://127.0.0.1:" in result.output
    assert "2 to compute; 2 cannot be run (recorded as failed)." in result.output
    assert "done: 2 written, 0 already complete, 2 failed" in result.output
    assert re.search(r"model loads: [12] workers?, 1 each", result.output)
    assert "line 2 (" in result.output and "Expected a prompt of at least one token" in result.output
    assert "line 3 (" in result.output and "Expected a prompt of at most 20 tokens (--max-tokens). Got" in result.output
    failures = open_store(out).failures()
    assert sorted((f["line"], f["stage"], f["error"]) for f in failures.values()) == \
        [(2, "tokenize", "PromptError"), (3, "tokenize", "PromptError")]
    assert [f["meta"] for f in failures.values() if f["line"] == 3] == [{"id": 7}]
    info = CliRunner().invoke(main, ["store", "info", str(out)])
    assert "2 complete prompts" in info.output and "2 failed prompts (retried by the next run)" in info.output
    with pytest.raises(StoreError, match="Got a failed one \\(line 2\\)"):
        open_store(out).get(next(pid for pid, f in failures.items() if f["line"] == 2))
    # the next run retries the failed prompts (here --max-tokens is raised, so the long one goes through)
    again = CliRunner().invoke(main, [*args[:-1], "64", "--scheduler", cluster[0]])
    assert again.exit_code == 3 and "2 already in" in again.output and "done: 1 written" in again.output
    assert [f["line"] for f in open_store(out).failures().values()] == [2]
    assert {p.prompt for p in open_store(out)} == {PROMPTS[0], PROMPTS[2], json.loads(lines[2])["prompt"]}


def test_a_prompt_that_fails_on_its_worker_is_recorded(tmp_path, cluster):
    from detjac.engine import ModelRef
    from detjac.model_settings import LoadSpec
    from detjac.runs.cluster import run_on_cluster
    from detjac.runs.plan import PromptTask, open_run_store, prepare_run

    _, client = cluster
    spec = LoadSpec(model=ModelRef.resolve("default"))
    plan = prepare_run("default", write_prompts(tmp_path / "p.txt", PROMPTS[:2]), spec,
                       row_block=None, max_tokens=None, keep="full", lenient=True)
    bad = PromptTask(plan.tasks[1].pid, plan.tasks[1].item, [1, 99999])  # a token id outside the vocabulary
    summary = plan.summary()
    with open_run_store(plan, tmp_path / "s.zarr") as store:
        run_on_cluster(client, plan, store, [plan.tasks[0], bad], summary, progress=False)
    assert summary.written == 1 and list(summary.failed) == [bad.pid]
    record = open_store(tmp_path / "s.zarr").failures()[bad.pid]
    assert record["stage"] == "compute" and record["error"] == "PromptError" and "[0, 6144)" in record["reason"]
    assert all(n == 1 for n, _ in summary.loads.values())


def test_ctrl_c_stops_cleanly_and_a_rerun_resumes(tmp_path, reference, cluster):
    import threading

    address, _ = cluster
    prompts = write_prompts(tmp_path / "p.txt", CORPUS)
    out = tmp_path / "s.zarr"
    args = ["run", "default", str(prompts), "--out", str(out), "--scheduler", address]
    pressed = threading.Event()

    def press_ctrl_c_mid_prompt():  # a real SIGINT to this process, as a terminal's Ctrl-C, mid-prompt: it wakes
        deadline = time.monotonic() + 120  # the main thread even while it waits for the workers' results
        while not _attempts(out) and time.monotonic() < deadline:
            time.sleep(0.005)
        pressed.set()
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever ran before
    try:
        threading.Thread(target=press_ctrl_c_mid_prompt, daemon=True).start()
        result = CliRunner().invoke(main, args)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert pressed.is_set() and result.exit_code == 130, result.output
    assert "kept in" in result.output and "interrupted: " in result.output
    done = len(open_store(out))
    assert done < len(CORPUS) and all(r.ok for r in open_store(out).verify())
    rerun = CliRunner().invoke(main, args)
    assert rerun.exit_code == 0, rerun.output
    assert f"{done} already in" in rerun.output and f"done: {len(CORPUS) - done} written" in rerun.output
    assert_equivalent_store(reference, out)


def test_a_second_run_on_a_store_being_written_is_refused(tmp_path, cluster):
    from detjac.store import create_store

    address, _ = cluster
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:1])
    out = tmp_path / "s.zarr"
    assert CliRunner().invoke(main, ["run", "default", str(prompts), "--out", str(out)]).exit_code == 0
    with create_store(out, open_store(out).run):  # this process now writes the store
        result = CliRunner().invoke(main, ["run", "default", str(prompts), "--out", str(out), "--scheduler", address])
    assert result.exit_code == 1
    assert f"Expected no other writer on {out}. Got one running (pid {os.getpid()} on host {socket.gethostname()}"\
        in result.output


def test_workers_write_only_under_the_lease_of_the_run_holding_the_store(tmp_path):
    import numpy as np

    from detjac.store import attach_store, create_store

    run = {"model_id": "m", "model_type": "llama", "config_sha256": "c", "revision": None, "dtype": "float64",
           "keep": "full", "detach": True, "position": -1, "target": "hidden", "row_block": 2}

    def write(store, pid):
        with store.begin(pid, n_rows=2, n_tokens=3, n_cols=4, dtype="float64", row_block=2) as w:
            w.write_rows(0, 2, np.ones((2, 3, 4)))
            for name, values in (("embeddings", np.ones((3, 4))), ("output", np.full(2, 12.0)),
                                 ("token_ids", np.arange(3))):
                w.write_array(name, values)
            w.commit({"prompt": pid, "n_tokens": 3, "reconstruction_error": 0.0, "dtype": "float64"})

    path = tmp_path / "s.zarr"
    with create_store(path, run) as owner:
        worker = attach_store(path, owner.lease)
        write(worker, "a" * 16)
        write(worker, "a" * 16)  # a second attempt at a committed prompt keeps the first, silently
        with pytest.raises(StoreError, match="held by the run that sent this prompt"):
            attach_store(path, "not-the-lease")
    with pytest.raises(StoreError, match="that run has ended or another took over"):
        write(worker, "b" * 16)  # the run is over: its late worker publishes nothing
    assert open_store(path).prompt_ids() == ["a" * 16] and open_store(path).staging_leftovers() == []


class _Settled:
    """A future as run_on_cluster sees it once it has settled."""

    def __init__(self, status, result=None, exception=None):
        self.status, self._result, self._exception = status, result, exception

    def result(self):
        return self._result

    def exception(self):
        return self._exception


def test_how_settled_prompts_are_counted_recorded_or_stop_the_run(tmp_path):
    from distributed import KilledWorker

    from detjac.errors import WorkerError
    from detjac.runs.cluster import PromptOutcome, _collect
    from detjac.runs.plan import PromptTask, RunSummary
    from detjac.runs.prompts import PromptLine
    from detjac.store import create_store

    run = {"model_id": "m", "model_type": "llama", "config_sha256": "c", "revision": None, "dtype": "float64",
           "keep": "full", "detach": True, "position": -1, "target": "hidden", "row_block": 2}
    task = PromptTask("0123456789abcdef", PromptLine(4, "a prompt"), [1, 2])
    summary = RunSummary()
    with create_store(tmp_path / "s.zarr", run) as store:
        _collect(store, summary, task, _Settled("finished", PromptOutcome(task.pid, "tcp://w1", 1, 0.5, 1e-15)))
        assert summary.written == 1 and summary.loads == {"tcp://w1": (1, 0.5)}
        died = KilledWorker(task.pid, SimpleNamespace(address="tcp://w2"), 3)
        _collect(store, summary, task, _Settled("error", exception=died))
        assert summary.failed[task.pid].stage == "worker" and summary.failed[task.pid].error == "KilledWorker"
        assert store.failures()[task.pid]["line"] == 4
        _collect(store, summary, task, _Settled("error", exception=OSError("stale file handle")))
        assert "OSError: stale file handle (after 3 attempts)" in store.failures()[task.pid]["reason"]
        with pytest.raises(WorkerError, match="could not load the model"):
            _collect(store, summary, task, _Settled("error", exception=WorkerError("could not load the model")))


# Whole `detjac run`s on the default model or a cluster: seconds each.
pytestmark = pytest.mark.slow
