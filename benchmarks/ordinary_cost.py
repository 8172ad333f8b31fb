"""What the ordinary Jacobian costs beside the detached one, measured in one process (resumable).

``detjac jacobian`` computes the ordinary (not detached) Jacobian by default, as the contrast of its reconstruction
error. The detached pass goes through the explicit pieces; the ordinary one through ``torch.func`` (in memory, the
whole model; layer-streamed, one layer at a time). Per case, in a fresh process: the engine's load, the detached
pass, then the ordinary pass of the same prompt, each timed, with the process's peak RSS after each, and the ratio
ordinary / detached. The passes run one after the other in one process, so both see about the same machine; the
load average at each start is recorded beside them.

Cases: the shipped model in memory and layer-streamed ("Kitten, n. A young"), and the Llama-3.2-1B shape (random
bf16 weights written once into ``--work``) layer-streamed under ``--max-memory cpu=1GiB`` in float32 at 17 tokens,
as ``detjac jacobian CHECKPOINT --streamed --max-memory cpu=1GiB --dtype float32`` runs it (about 13 minutes of 2
quiet cores with the checkpoint written).

Results go to ``benchmarks/results/ordinary_cost.json`` after every pass; a case already there is skipped, so the
script resumes where it stopped. Never a timed assertion::

    nohup .venv/bin/python -m benchmarks.ordinary_cost --work /tmp/detjac-rehearsal &
    .venv/bin/python -m benchmarks.ordinary_cost --table
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .support.real_shapes import REAL_SHAPES

RESULTS = Path(__file__).parent / "results" / "ordinary_cost.json"
KITTEN = "Kitten, n. A young"
TOKENS_1B = 17  # the prompt length the slow command was reported at


def cases(work: Path) -> dict[str, dict[str, Any]]:
    """Each case's model, engine arguments and prompt (the 1B checkpoint's path inside ``work``)."""
    return {
        "default-memory": {"model": "default", "options": {}, "prompt": KITTEN},
        "default-streamed": {"model": "default", "options": {"streamed": True}, "prompt": KITTEN},
        "llama-3.2-1b-streamed-1GiB-float32": {
            "model": str(work / "llama32-1b-bf16"), "prompt": list(range(1, 1 + 37 * TOKENS_1B, 37)),
            "options": {"streamed": True, "max_memory": "cpu=1GiB", "dtype": "float32"}, "random_1b": True},
    }


def checkpoint(folder: Path) -> None:
    """The random Llama-3.2-1B-shaped checkpoint, written once (reused when it is there)."""
    import torch

    from .support.random_weights import write_random_checkpoint

    if not (folder / "model.safetensors.index.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        write_random_checkpoint(folder, REAL_SHAPES["llama-3.2-1b"], torch.bfloat16)


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0]) if Path("/proc/loadavg").exists() else float("nan")


def child(case: dict[str, Any]) -> None:
    """One case in this (fresh) process: one JSON line per pass on stdout, as it finishes."""
    import torch

    from detjac.engine import honour_cpu_budget, jacobian, load_engine
    from detjac.machine import peak_mib

    options = dict(case["options"])
    if "dtype" in options:
        options["dtype"] = getattr(torch, options["dtype"])
    honour_cpu_budget(options.get("device", "cpu"), options.get("max_memory"))  # as the detjac command does
    t0 = time.perf_counter()
    engine = load_engine(case["model"], **options)
    print(json.dumps({"pass": "load", "seconds": time.perf_counter() - t0, "peak_rss_mib": peak_mib()}), flush=True)
    for name, eng in (("detached", engine), ("ordinary", engine.ordinary())):
        load, t1 = _load(), time.perf_counter()
        res = jacobian(eng, case["prompt"])
        print(json.dumps({"pass": name, "seconds": time.perf_counter() - t1, "load_average_at_start": load,
                          "peak_rss_mib": peak_mib(), "tokens": len(res.token_ids),
                          "reconstruction_error": float(res.reconstruction_error),
                          "torch_threads": torch.get_num_threads()}), flush=True)


def table(report: dict[str, Any]) -> str:
    """One markdown row per case measured: seconds of each pass, the ratio, the peak RSS."""
    lines = ["| case | tokens | detached s | ordinary s | ordinary / detached | peak RSS MiB | load at start |",
             "|---" * 7 + "|"]
    for name, r in report.get("cases", {}).items():
        det, ordi = r.get("detached"), r.get("ordinary")
        if not det:
            continue
        def secs(p: dict[str, Any] | None) -> str:
            return f"{p['seconds']:.1f}" if p else "—"

        ratio = f"{ordi['seconds'] / det['seconds']:.1f}" if ordi else "—"
        loads = " / ".join(f"{p['load_average_at_start']:.1f}" for p in (det, ordi) if p)
        lines.append(f"| {name} | {det['tokens']} | {secs(det)} | {secs(ordi)} | {ratio} | "
                     f"{max(p['peak_rss_mib'] for p in (det, ordi) if p):.0f} | {loads} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/detjac-rehearsal"), help="where the 1B checkpoint goes")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--only", nargs="+", default=[], metavar="CASE", help="run only these cases")
    p.add_argument("--again", action="store_true", help="run the chosen cases again, replacing their results")
    p.add_argument("--table", action="store_true", help="print the results' table, then stop")
    p.add_argument("_child", nargs="?", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        child(json.loads(args._child))
        return
    done: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    if args.table:
        print(table(done))
        return
    every = cases(args.work)
    unknown = set(args.only) - set(every)
    if unknown:
        raise SystemExit(f"Expected --only among {', '.join(every)}. Got {', '.join(sorted(unknown))}.")
    done.setdefault("cases", {})
    for name, case in every.items():
        if (args.only and name not in args.only) or (name in done["cases"] and "ordinary" in done["cases"][name]
                                                     and not args.again):
            continue
        if case.get("random_1b"):
            checkpoint(Path(case["model"]))
        print(f"{name}: running", flush=True)
        entry: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                                 "options": case["options"]}
        proc = subprocess.Popen([sys.executable, "-m", __spec__.name, json.dumps(case)], stdout=subprocess.PIPE,
                                text=True)
        for line in proc.stdout:  # each pass saved as it finishes: a kill keeps the detached pass
            record = json.loads(line)
            entry[record.pop("pass")] = record
            done["cases"][name] = entry
            args.out.write_text(json.dumps(done, indent=1) + "\n")
            print(f"{name}: {json.dumps(record)}", flush=True)
        if proc.wait() != 0:
            print(f"{name} failed (exit {proc.returncode})", flush=True)
    print(table(done))


if __name__ == "__main__":
    main()
