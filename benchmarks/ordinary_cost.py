"""What the ordinary Jacobian costs beside the detached one, measured in one process (resumable).

``detjac jacobian`` computes the ordinary (not detached) Jacobian by default, as the contrast of its reconstruction
error. The detached pass goes through the explicit pieces; the ordinary one through ``torch.func`` (in memory, the
whole model; layer-streamed, one layer at a time). Per case, in a fresh process: the engine's load, the detached
pass, then the ordinary pass of the same prompt, each timed, with the process's peak RSS after each, and the ratio
ordinary / detached. The passes run one after the other in one process, so both see about the same machine; the
load average at each start is recorded beside them.

Cases: the shipped model in memory and layer-streamed ("Kitten, n. A young"), and the Llama-3.2-1B shape (random
bf16 weights written once into ``--work``) layer-streamed under ``--max-memory cpu=1GiB`` in float32 at 17 tokens,
as ``detjac jacobian CHECKPOINT --streamed --max-memory cpu=1GiB --dtype float32`` runs it: by default cut to its
first 2 layers (every layer of the 1B shape is the same shape, and the streamed engine runs one at a time, so both
passes scale with the depth: the table extrapolates each pass's per-layer time to the 16 layers), or whole with
``--only llama-3.2-1b-streamed-1GiB-float32`` (about an hour of 2 quiet cores).

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


FULL_1B = "llama-3.2-1b-streamed-1GiB-float32"
CUT_LAYERS = 2  # the default 1B case's depth (of 16)


def cases(work: Path) -> dict[str, dict[str, Any]]:
    """Each case's engine arguments, prompt and depth (the 1B checkpoints' paths inside ``work``); the whole 1B
    case only when asked for by name."""
    streamed_1b = {"streamed": True, "max_memory": "cpu=1GiB", "dtype": "float32"}
    ids = list(range(1, 1 + 37 * TOKENS_1B, 37))
    full = REAL_SHAPES["llama-3.2-1b"]["num_hidden_layers"]
    return {
        "default-memory": {"model": "default", "options": {}, "prompt": KITTEN},
        "default-streamed": {"model": "default", "options": {"streamed": True}, "prompt": KITTEN},
        f"llama-3.2-1b-{CUT_LAYERS}-layers-streamed-1GiB-float32": {
            "model": str(work / f"llama32-1b-{CUT_LAYERS}-layers-bf16"), "prompt": ids, "options": streamed_1b,
            "layers": CUT_LAYERS, "of_layers": full},
        FULL_1B: {"model": str(work / "llama32-1b-bf16"), "prompt": ids, "options": streamed_1b, "layers": full,
                  "of_layers": full, "on_request": True},
    }


def checkpoint(folder: Path, layers: int) -> None:
    """A random Llama-3.2-1B-shaped checkpoint of ``layers`` layers, written once (reused when it is there)."""
    import torch

    from .support.random_weights import write_random_checkpoint

    if not (folder / "model.safetensors.index.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        write_random_checkpoint(folder, {**REAL_SHAPES["llama-3.2-1b"], "num_hidden_layers": layers}, torch.bfloat16)


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
    t0 = time.perf_counter()
    engine = load_engine(case["model"], **options)
    honour_cpu_budget(engine)  # as the detjac command does
    print(json.dumps({"pass": "load", "seconds": time.perf_counter() - t0, "peak_rss_mib": peak_mib()}), flush=True)
    for name, eng in (("detached", engine), ("ordinary", engine.ordinary())):
        load, t1 = _load(), time.perf_counter()
        res = jacobian(eng, case["prompt"])
        print(json.dumps({"pass": name, "seconds": time.perf_counter() - t1, "load_average_at_start": load,
                          "peak_rss_mib": peak_mib(), "tokens": len(res.token_ids),
                          "reconstruction_error": float(res.reconstruction_error),
                          "torch_threads": torch.get_num_threads()}), flush=True)


def table(report: dict[str, Any]) -> str:
    """One markdown row per case measured: seconds of each pass (a depth-cut case's also extrapolated to the whole
    depth, per layer), the ratio, the peak RSS."""
    lines = ["| case | tokens | detached s | ordinary s | ordinary / detached | peak RSS MiB | load at start |",
             "|---" * 7 + "|"]
    for name, r in report.get("cases", {}).items():
        det, ordi = r.get("detached"), r.get("ordinary")
        if not det:
            continue
        scale = r["of_layers"] / r["layers"] if r.get("layers") else 1.0

        def secs(p: dict[str, Any] | None, scale: float = scale) -> str:
            if not p:
                return "—"
            return f"{p['seconds']:.1f}" + (f" (× {scale:g}: {p['seconds'] * scale:.0f})" if scale != 1 else "")

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
        wanted = name in args.only if args.only else not case.get("on_request")
        if not wanted or (name in done["cases"] and "ordinary" in done["cases"][name] and not args.again):
            continue
        if "layers" in case:
            checkpoint(Path(case["model"]), case["layers"])
        print(f"{name}: running", flush=True)
        entry: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                                 "options": case["options"], "layers": case.get("layers"),
                                 "of_layers": case.get("of_layers")}
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
