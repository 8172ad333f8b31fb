"""Corpus runs on a dask.distributed LocalCluster against a run in one process: prompts per minute.

The same prompts (the first ``--prompts`` held-out prompts of ``benchmarks/data/heldout_prompts.txt``)
of the shipped default model go, in float64, into a fresh store in each configuration:

- ``single``: one process computes every prompt (``detjac run`` without ``--workers``);
- ``workers=1`` and ``workers=2``: a LocalCluster of that many worker processes (``--workers N``),
  one dask thread each and this machine's cores shared out as torch threads, as the CLI does.

Each configuration runs in a fresh Python process through the same functions ``detjac run``
calls, which reports its phases: planning (the client loads the model and tokenizes), cluster
start, the prompt phase (first submission to last commit: it includes each worker's first
import of torch and its model load) and shutdown. Reported per configuration: prompts per
minute over the prompt phase and end to end (process start to exit), the steady rate
(after every worker's first commit), the time to the first commit, and for the clusters
the model loads per worker and the seconds each load took (the load alone, not the
imports). The stores are then compared: every array byte and attribute but timestamps must
agree with the single-process store. Never a timed assertion: a report, also written to
``benchmarks/results/distributed.json``. The machine's load average is recorded with it;
other work on the machine changes the figures.

    .venv/bin/python -m benchmarks.distributed_bench                  # ~10 minutes on 2 cores
    .venv/bin/python -m benchmarks.distributed_bench --prompts 8 --rounds 1 --out /tmp/d.json   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONFIGS = ("single", "workers=1", "workers=2")


def one(config: str, prompts: str, out: str) -> dict[str, Any]:
    """Run one configuration in this (fresh) process; returns its phase timings."""
    started = time.perf_counter()
    import torch  # noqa: F401 - imported first, so that the planning phase is not the imports

    from detjac.engine import ModelRef
    from detjac.model_settings import LoadSpec
    from detjac.runs.cluster import run_on_cluster
    from detjac.runs.local import run_local
    from detjac.runs.plan import RunSummary, open_run_store, prepare_run
    from detjac.runs.scheduler import ClusterOptions, dask_cluster

    class TimedSummary(RunSummary):
        """Counts as the run does, and notes when each prompt was committed."""

        committed: list[float] = []

        def add_written(self, error: float) -> None:
            super().add_written(error)
            self.committed.append(time.perf_counter())

    imported = time.perf_counter()
    workers = int(config.split("=")[1]) if config.startswith("workers=") else 0
    spec = LoadSpec(model=ModelRef.resolve("default"))
    plan = prepare_run("default", prompts, spec, row_block=None, max_tokens=None, keep="full",
                       lenient=workers > 0, load_device="cpu")
    summary = TimedSummary(duplicates=plan.duplicates, blank_lines=plan.prompts.blank)
    planned = time.perf_counter()
    phases: dict[str, float] = {"imports_s": imported - started, "plan_s": planned - imported}
    with open_run_store(plan, out) as store:
        tasks = plan.pending(store, summary)
        if workers:
            cluster_started = time.perf_counter()
            with dask_cluster(ClusterOptions(workers), trim_memory=False, log=print) as client:
                phases["cluster_start_s"] = time.perf_counter() - cluster_started
                begin = time.perf_counter()
                run_on_cluster(client, plan, store, tasks, summary, torch_threads=max(1, _cores() // workers),
                               local=True, progress=False)
                phases["prompts_s"] = time.perf_counter() - begin
                closing = time.perf_counter()
            phases["cluster_close_s"] = time.perf_counter() - closing
        else:
            begin = time.perf_counter()
            run_local(plan, store, tasks, summary)
            phases["prompts_s"] = time.perf_counter() - begin
    done = summary.committed
    phases["first_prompt_s"] = done[0] - begin  # a worker's first prompt includes its imports and model load
    wave = max(1, workers)  # the rate once every worker has committed its first prompt
    phases["steady_prompts_per_min"] = 60 * (len(done) - wave) / (done[-1] - done[wave - 1])
    return {"config": config, "written": summary.written, "failed": len(summary.failed), **phases,
            "loads": {worker: {"loads": n, "load_s": s} for worker, (n, s) in summary.loads.items()},
            "worst_error": summary.worst_error}


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def measure(config: str, prompts: Path, folder: Path) -> dict[str, Any]:
    """One configuration in a fresh process; adds the end-to-end wall time."""
    out = folder / f"{config.replace('=', '')}.zarr"
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "--one", config, "--prompt-file", str(prompts),
                           "--store", str(out)], capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{config} failed:\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "wall_s": wall, "store": str(out)}


def same_store(a: str, b: str) -> bool:
    """The stores hold the same prompts, ids and attributes, and numbers equal within float64 rounding
    (``detjac.store.compare_stores``, as the tests compare stores computed with other thread or worker counts: BLAS
    need not round alike there)."""
    from detjac.store import compare_stores

    return compare_stores(a, b).equivalent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each configuration (the median is shown)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "distributed.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.prompt_file, args.store)))
        return
    lines = (HERE / "data" / "heldout_prompts.txt").read_text(encoding="utf-8").splitlines()[:args.prompts]
    load_at_start = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="detjac-distributed-bench-") as tmp:
        folder = Path(tmp)
        prompts = folder / "prompts.txt"
        prompts.write_text("\n".join(lines) + "\n", encoding="utf-8")
        for r in range(args.rounds):
            for config in CONFIGS:
                run_folder = folder / f"round{r}"
                run_folder.mkdir(exist_ok=True)
                result = measure(config, prompts, run_folder)
                result["equal_to_single"] = same_store(str(run_folder / "single.zarr"), result["store"])
                runs[config].append(result)
                print(f"round {r + 1} {config:<10} prompts {result['prompts_s']:6.1f} s, wall {result['wall_s']:6.1f} s"
                      f", equal {result['equal_to_single']}", flush=True)
    n = len(lines)
    table = {}
    for config, results in runs.items():
        prompts_s = statistics.median(r["prompts_s"] for r in results)
        wall_s = statistics.median(r["wall_s"] for r in results)
        loads = [w["loads"] for r in results for w in r["loads"].values()]
        load_s = [w["load_s"] for r in results for w in r["loads"].values()]
        table[config] = {"prompts_per_min": 60 * n / prompts_s, "prompts_per_min_end_to_end": 60 * n / wall_s,
                         "steady_prompts_per_min": statistics.median(r["steady_prompts_per_min"] for r in results),
                         "first_prompt_s": statistics.median(r["first_prompt_s"] for r in results),
                         "prompts_s": prompts_s, "wall_s": wall_s,
                         "loads_per_worker": sorted(set(loads)), "model_load_s_per_worker": load_s,
                         "equal_to_single": all(r["equal_to_single"] for r in results)}
    base = table["single"]["prompts_per_min"]
    for row in table.values():
        row["speedup_vs_single"] = row["prompts_per_min"] / base
    report = {"machine": {"cpus_usable": _cores(), "loadavg_at_start": load_at_start,
                          "loadavg_at_end": os.getloadavg(), "python": sys.version.split()[0]},
              "prompts": n, "model": "default (gcide-llama, d_model 256, 4 layers), float64, CPU",
              "rounds": args.rounds, "summary": table, "runs": runs}
    print(f"\n{n} prompts, default model, float64; median of {args.rounds} rounds; {_cores()} cores, load average at "
          f"start {load_at_start[0]:.2f}")
    print(f"{'config':<10} {'prompts/min':>12} {'steady':>7} {'end to end':>11} {'speedup':>8} {'1st prompt':>11} "
          f"{'loads/worker':>13} {'load s':>7} {'equal':>9}")
    for config, row in table.items():
        load_s = f"{statistics.median(row['model_load_s_per_worker']):.2f}" if row["model_load_s_per_worker"] else "-"
        loads = ",".join(map(str, row["loads_per_worker"])) or "-"
        print(f"{config:<10} {row['prompts_per_min']:>12.1f} {row['steady_prompts_per_min']:>7.1f} "
              f"{row['prompts_per_min_end_to_end']:>11.1f} {row['speedup_vs_single']:>7.2f}x "
              f"{row['first_prompt_s']:>10.1f}s {loads:>13} {load_s:>7} {str(row['equal_to_single']):>9}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
