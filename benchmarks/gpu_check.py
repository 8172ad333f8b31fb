"""The GPU check: every measurement of the GPU issue in one call, prepared to run within minutes on one GPU.

A GPU is lent to some work only, for 15 minutes, on a machine with no network: this script is the whole call, sized
so that the machine's start and two runs fit. It runs each step in a child process under a deadline
(``--budget-s``, 300 s by default), exactness first, then float64 and the paper's method, the SVD after them; it
prints timestamped progress, and rewrites ``DIR/gpu.json`` (and appends ``DIR/gpu.log``) after every step, so a run
cut short still says how far it got; a step that runs out of time keeps what its child wrote so far (per row block)
and is marked ``cut_short``, and a step with too little time left is skipped, saying so. The checkpoints are written
once under ``--tmp``: a second run with the same ``--tmp`` skips the writes and reaches the later steps.

Steps, in order (``--only a,b`` runs some; ``--skip`` leaves some out):

machine        the GPU, its memory, driver, torch and CUDA versions; ``torch.matmul`` rates (bf16, float32 with
               TF32 off and on, float64)
exactness      the shipped default model and tiny random configs of six families (llama, qwen3, gemma3, phi3,
               olmo2, qwen3_moe), the in-memory engine: float64 on the device against float64 on the CPU (relative
               to the largest entry; ``exact`` is <= 1e-12), the device's own reconstruction error, and float32
               with TF32 off and on against the same CPU float64 J
graph-heads    an attribution graph with head loadings (8 tokens, 64 neurons, 8 links split by head) on a random
               checkpoint of SmolLM2-135M's shape (the real file cannot travel), float64, on the device and on the
               same machine's CPU in this run: the same nodes and links, every number within float64 rounding
checkpoint-8b, checkpoint-70b, checkpoint-q4
               the random checkpoints of the shapes below written under ``--tmp`` (bf16 safetensors; a GGUF of Q4_0
               blocks for q4; a rerun with the same ``--tmp`` finds them and skips the write)
8b-16-f32      Llama-3.1-8B's shape (random bf16 weights, all 32 layers, written by the script), the layer-streamed
               engine, the output's J at 16 tokens in float32, under the smallest of 8, 12, 16, 24, 32, 48 and 60 GiB
               (``--max-memory <device>=...``) that the engine takes (those it refuses are kept with its reason):
               seconds, seconds per layer per row block, achieved TFLOP/s against ``torch.matmul`` of the sweep's
               GEMM shape in the same process (the TFLOP/s count the unfolded sweep's FLOPs: where the MLP folds,
               it does fewer), peak GPU memory (the allocator's; the driver's, sampled per row
               block), host RSS, bytes read and copied host to device, the reconstruction error of the J
8b-16-f64      the same in float64
reference      ``torch.autograd.functional.jacobian(vectorize=True)`` on the detached 8B-shaped model held on the
               device in float32 (the paper's method): 16 tokens, then 64, until it runs out of memory; its J
               against detjac's at 16 tokens
70b-16-f32     Llama-3.3-70B's shape, 3 of its 80 layers (embeddings tied: the output's J never reads the
               unembedding), the same; each layer's time per row block, extrapolated to 80 layers (one layer in
               float32 is 3.2 GiB: it is widened a matrix at a time under 8 GiB)
70b-16-f64     the same in float64
q4-16-f32      a GGUF of Q4_0 blocks at the 70B layer shape (2 layers, a 32,768-token vocabulary), dequantized a
               matrix at a time as each layer streams in, under 8 GiB on the device; extrapolated to 80 layers
svd-1024       the matrix-free top-16 SVD (block Lanczos on J and J^T products) at 1,024 tokens on the 8B shape,
               float32, a 60 GiB budget so the layers stay on the device between products
70b-16-bf16    the 70B shape in bfloat16 (not exact; the paper's run was float16), where 8 GiB holds it
cli            ``detjac run`` on the 8B shape (the default model's tokenizer copied into the checkpoint), 16-token
               prompt, float32, ``--device`` and ``--max-memory``: the command a user types, store written
8b-64-f32, 8b-64-f64
               the 8B shape at 64 tokens

``--dry-run`` runs exactly these code paths on the CPU at tiny shapes (in ``make test``), so the call cannot rot
before a GPU is lent. On the GPU machine (no network; the missing packages travel as wheels, ``make gpu-wheels``
here), from the repository root:

    bash scripts/gpu_install.sh -- python -m benchmarks.gpu_check --out "$OUT"
    .venv/bin/python -m benchmarks.gpu_check --dry-run --out /tmp/gpu-dry

Then ``benchmarks/results/gpu.json`` is ``DIR/gpu.json``, and ``--table DIR/gpu.json`` prints the docs table.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .support.gpu_run import Partial, say
from .support.gpu_steps import run_step
from .support.gpu_tables import plans, table

SCHEMA = 1
BUDGET_S = 300.0
RESERVE_S = 8.0  # left at the end for the last gpu.json
MIN_STEP_S = 20.0  # a step with less time than this left is skipped, not started

# The steps in order, each with the longest it may take on an H100 (seconds; ten times that in the dry run):
# exactness, float64 and the reference before the SVD; what a first run has no time for, a second (its checkpoints
# already written) reaches.
STEPS: list[tuple[str, float]] = [
    ("machine", 40), ("exactness", 60), ("graph-heads", 90), ("checkpoint-8b", 120), ("8b-16-f32", 90),
    ("8b-16-f64", 100), ("reference", 120), ("checkpoint-70b", 60), ("70b-16-f32", 90), ("70b-16-f64", 90),
    ("checkpoint-q4", 120), ("q4-16-f32", 90), ("svd-1024", 120), ("70b-16-bf16", 60), ("cli", 90),
    ("8b-64-f32", 120), ("8b-64-f64", 120),
]


# -- the parent side: deadlines, the log, gpu.json -----------------------------------------------------------


DONE = "@@gpu_check step done"


def worker(args: argparse.Namespace) -> None:
    """The child: reads step names on stdin, runs each (imports paid once), answers ``DONE name code`` on stdout."""
    import gc
    import traceback

    import torch

    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        code = 0
        try:
            run_step(name, args, Partial(args.out / f"step-{name}.json"))
        except BaseException as err:  # noqa: BLE001  reported, and the next step runs
            traceback.print_exc()
            code = err.code if isinstance(err, SystemExit) and isinstance(err.code, int) and err.code else 1
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"{DONE} {name} {code}", flush=True)


class Worker:
    """The worker process, its output echoed to the terminal and the log; :meth:`run` waits for one step's answer
    under a timeout (then the worker is killed, and the next step starts a new one)."""

    def __init__(self, args: argparse.Namespace, log: Any) -> None:
        cmd = [sys.executable, "-m", __spec__.name, "--worker", "--out", str(args.out), "--device",
               args.device, "--tmp", args.tmp, *(["--dry-run"] if args.dry_run else [])]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.answers: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self.log = log
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(DONE):
                name, code = line.split()[-2:]
                self.answers.put((name, int(code)))
                continue
            sys.stdout.write(line)
            sys.stdout.flush()
            if not self.log.closed:  # the parent closes the log once the last step is done
                self.log.write(line)
                self.log.flush()
        self.answers.put(None)  # the worker's output ended: it exited

    def run(self, name: str, timeout: float) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        try:
            answer = self.answers.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            return "cut_short"
        if answer is None:
            return f"failed (the worker died: exit {self.proc.wait()})"
        return "done" if answer[1] == 0 else f"failed (exit {answer[1]})"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self) -> None:
        if self.alive():
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def goals(steps: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, judged from what the run measured (``None``: not measured)."""

    def got(step: str, *keys: str) -> Any:
        value: Any = steps.get(step, {}).get("result", {})
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        return value

    runs = {"f32": "70b-16-f32", "f64": "70b-16-f64", "bf16": "70b-16-bf16", "q4_0_f32": "q4-16-f32"}
    peaks = {key: got(step, "gpu_allocated_peak_gib") for key, step in runs.items()}
    used = {key: got(step, "max_memory") for key, step in runs.items()}
    f32 = got("70b-16-f32", "extrapolated_80_layers", "jacobian_s")
    f64 = got("70b-16-f64", "extrapolated_80_layers", "jacobian_s")
    share = got("8b-16-f32", "share_of_matmul")
    svd = got("svd-1024", "seconds")
    graph = got("graph-heads", "agreement")
    measured = {key: {"peak_gib": v, "max_memory": used[key], "met": v <= 8.0} for key, v in peaks.items()
                if v is not None}
    return {
        "70b_peak_gpu_le_8gib": measured or None,
        "70b_16_tokens_float32_le_120s": None if f32 is None else {"extrapolated_s": f32, "met": f32 <= 120},
        "70b_16_tokens_float64_le_300s": None if f64 is None else {"extrapolated_s": f64, "met": f64 <= 300},
        "8b_share_of_matmul_ge_0.5": None if share is None else {"measured": share, "met": share >= 0.5},
        "svd_1024_tokens_le_300s": None if svd is None else {"measured_s": svd, "met": svd <= 300},
        "graph_heads_device_equals_cpu_float64": None if graph is None else {**graph,
                                                                             "met": graph["equal_within_float64"]},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="folder for gpu.json and gpu.log (created)")
    p.add_argument("--device", default=None, help="default: cuda:0 (cpu with --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="the same code paths at tiny shapes, on the CPU")
    p.add_argument("--budget-s", type=float, default=None, help=f"deadline for all steps (default {BUDGET_S:.0f} s)")
    p.add_argument("--only", default=None, help="comma-separated steps to run (default: all, in order)")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out")
    p.add_argument("--tmp", default=None, help="where the checkpoints go (default /tmp/detjac-gpu-check)")
    p.add_argument("--table", type=Path, help="print the docs table of this gpu.json, then stop")
    p.add_argument("--plans", action="store_true", help="print the planner's row blocks per budget, then stop")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--step-timeout-s", default="", help=argparse.SUPPRESS)  # the tests' cut: NAME=SECONDS,...
    args = p.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    if args.plans:
        print(plans())
        return
    if args.out is None:
        p.error("--out DIR is required")
    args.device = args.device or ("cpu" if args.dry_run else "cuda:0")
    args.tmp = args.tmp or "/tmp/detjac-gpu-check"
    Path(args.tmp).mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return
    names = [n for n, _ in STEPS]
    chosen = names if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    skipped = {n.strip() for n in args.skip.split(",") if n.strip()}
    unknown = sorted((set(chosen) | skipped) - set(names))
    if unknown:
        p.error(f"expected steps among {', '.join(names)}; got {', '.join(unknown)}")
    cuts = {k: float(v) for k, v in (item.split("=") for item in args.step_timeout_s.split(",") if item)}
    budget = args.budget_s if args.budget_s is not None else (600.0 if args.dry_run else BUDGET_S)
    deadline = time.monotonic() + budget
    result_file, log_file = args.out / "gpu.json", args.out / "gpu.log"
    report: dict[str, Any] = {"schema": SCHEMA, "dry_run": args.dry_run, "device": args.device,
                              "started_utc": datetime.now(UTC).isoformat(timespec="seconds"), "budget_s": budget,
                              "steps": {}}

    def save() -> None:
        report["goals"] = goals(report["steps"])
        tmp = result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        os.replace(tmp, result_file)

    with open(log_file, "a") as log:
        child: Worker | None = None
        try:
            for name, cap in STEPS:
                if name not in chosen or name in skipped:
                    continue
                left = deadline - time.monotonic() - RESERVE_S
                if left < MIN_STEP_S:
                    report["steps"][name] = {"status": "skipped",
                                             "why": f"{max(left, 0):.0f} s left of the {budget:.0f} s budget"}
                    say(f"{name}: skipped, {max(left, 0):.0f} s left")
                    save()
                    continue
                timeout = min(cap * (10 if args.dry_run else 1), left, cuts.get(name, left))
                partial = args.out / f"step-{name}.json"
                partial.unlink(missing_ok=True)
                say(f"{name}: started (at most {timeout:.0f} s)")
                t0 = time.monotonic()
                if child is None or not child.alive():
                    child = Worker(args, log)
                status = child.run(name, timeout)
                seconds = time.monotonic() - t0
                result = json.loads(partial.read_text()) if partial.is_file() else {}
                report["steps"][name] = {"status": status, "seconds": seconds, "result": result}
                say(f"{name}: {status} in {seconds:.1f} s")
                save()
        finally:
            if child is not None:
                child.close()
    report["finished_utc"] = datetime.now(UTC).isoformat(timespec="seconds")
    save()
    failed = [n for n, s in report["steps"].items() if s["status"].startswith("failed")]
    say(f"wrote {result_file}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    if failed:
        sys.exit(1)



if __name__ == "__main__":
    main()
