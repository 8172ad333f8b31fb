"""Layers kept in their stored dtype, rehearsed on the CPU at a real model's shape (resumable).

A Llama-3.2-1B-shaped model (random weights, tied embeddings, vocabulary 128,256) stored two ways: bf16 safetensors
and a GGUF of Q4_0 blocks (the lowest-bit type the ``gguf`` package writes), each streamed by the layer-streamed
engine under ``--max-memory cpu=1GiB`` in float32 and float64, with the row block the cost model picks (passed
explicitly). Per run, in a fresh process: peak RSS of the process, the bytes of layers read for the prompt, seconds
(trace, blocks, total), seconds per layer per row block, and the float64-accumulated reconstruction error. Optionally
(``--with-8b``) the Llama-3.1-8B shape in bf16 under ``cpu=4GiB`` in float32 at 8 tokens (21 minutes of 2 quiet
cores, 37 GiB read).

Results go to ``benchmarks/results/stored_rehearsal.json`` after every run; a run already there is skipped, so the
script resumes where it stopped. The checkpoints are written once into ``--work`` (reused)::

    nohup .venv/bin/python -m benchmarks.stored_rehearsal --work /tmp/detjac-rehearsal &
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

RESULTS = Path(__file__).parent / "results" / "stored_rehearsal.json"
LLAMA32_1B: dict[str, Any] = REAL_SHAPES["llama-3.2-1b"]
LLAMA31_8B: dict[str, Any] = REAL_SHAPES["llama-3.1-8b"]
TOKENS = 8
QUANT = "Q4_0"


def checkpoints(work: Path, with_8b: bool) -> dict[str, Path]:
    """The random checkpoints, written once (a folder or file that exists is reused)."""
    import torch

    from .support.random_weights import write_random_checkpoint, write_random_gguf

    work.mkdir(parents=True, exist_ok=True)
    out = {"1b-bf16": work / "llama32-1b-bf16", "1b-q4_0": work / "llama32-1b-q4_0.gguf"}
    if not (out["1b-bf16"] / "model.safetensors.index.json").exists():
        write_random_checkpoint(out["1b-bf16"], LLAMA32_1B, torch.bfloat16)
    if not out["1b-q4_0"].exists():
        tmp = out["1b-q4_0"].with_suffix(".partial")
        write_random_gguf(tmp, LLAMA32_1B, QUANT)
        tmp.rename(out["1b-q4_0"])
    if with_8b:
        out["8b-bf16"] = work / "llama31-8b-bf16"
        if not (out["8b-bf16"] / "model.safetensors.index.json").exists():
            write_random_checkpoint(out["8b-bf16"], LLAMA31_8B, torch.bfloat16)
    return out


def child(source: str, dtype_name: str, budget: str, tokens: int) -> dict[str, Any]:
    """One streamed run, in this (fresh) process."""
    import torch

    from detjac.engine import StreamedEngine, honour_cpu_budget, jacobian
    from detjac.engine.types import Plan
    from detjac.machine import peak_mib, reset_peak
    from detjac.targets import OUTPUTS

    dtype = getattr(torch, dtype_name)
    t0 = time.perf_counter()
    sm = StreamedEngine(source, dtype=dtype, max_memory=budget)
    honour_cpu_budget(sm.device, budget)  # as the detjac command does
    ids = list(range(1, 1 + 37 * tokens, 37))  # ids the tiny checks hold too
    plan: Plan = sm.cost.plan(tokens, [OUTPUTS], mode="reverse")  # the cost model's block, passed explicitly
    load_s = time.perf_counter() - t0
    # the interpreter, torch, transformers and the skeleton, before any layer is read; the peak counted from here (a
    # transient of loading, such as a GGUF's tokenizer read in Python, is not the run's)
    base_mib = reset_peak()
    t1 = time.perf_counter()
    res = jacobian(sm, ids, row_block=plan.row_block, check=False)
    seconds = time.perf_counter() - t1
    stats, cost = sm.stats, sm.cost
    return {
        "source": Path(source).name, "dtype": dtype_name, "budget": budget, "tokens": tokens,
        "row_block": plan.row_block, "row_blocks": plan.n_row_blocks, "seconds": seconds, "load_s": load_s,
        "seconds_per_layer_per_row_block": seconds / sm.n_layers / (plan.n_row_blocks + 1),  # the trace: one pass
        "peak_rss_mib": peak_mib(), "rss_before_layers_mib": base_mib,
        "jacobian_mib": res.jacobian.numel() * res.jacobian.element_size() / 2**20,
        "layer_bytes_read": stats.bytes_read, "gib_read": stats.bytes_read / 2**30,
        "layers_loaded": stats.layers_loaded, "layers_kept": stats.layers_kept,
        "stored_layer_mib": cost.stored_bytes / 2**20, "compute_layer_mib": cost.layer_bytes / 2**20,
        "weights_mib_counted": cost.held_weights_bytes(tokens) / 2**20, "widen": plan.widen,
        "matrices_widened": getattr(stats, "matrices_widened", None),
        "reconstruction_error": float(res.reconstruction_error),
        "explicit_layers": stats.explicit_layers, "weight_wait_seconds": stats.weight_wait_seconds,
        "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
    }


def runs(paths: dict[str, Path]) -> list[tuple[str, str, str, str, int]]:
    """(name, source, dtype, budget, tokens) of every run, in order."""
    out = [(f"{which}-{dtype}", str(paths[which]), dtype, "cpu=1GiB", TOKENS)
           for which in ("1b-bf16", "1b-q4_0") for dtype in ("float32", "float64")]
    if "8b-bf16" in paths:
        out.append(("8b-bf16-float32", str(paths["8b-bf16"]), "float32", "cpu=4GiB", 8))
    return out


def table(report: dict[str, Any]) -> str:
    """The markdown table of docs/results/2026-11-28-layer-streamed-engine.md's table, one row per run done."""
    lines = ["| run | row blocks | seconds | s / layer / block | peak RSS MiB (before layers) | engine's share MiB | "
             "GiB of layers read | layer MiB stored / widened | reconstruction |", "|---" * 9 + "|"]
    for name, r in report.get("runs", {}).items():
        before = r.get("rss_before_layers_mib")
        share = f"{r['peak_rss_mib'] - before - r['jacobian_mib']:.0f} of {r['budget'].partition('=')[2]}" if before \
            else "—"  # the peak less what came before any layer and the J
        lines.append(f"| {name} | {r['row_blocks']} × {r['row_block']} | {r['seconds']:.0f} | "
                     f"{r['seconds_per_layer_per_row_block']:.1f} | {r['peak_rss_mib']:.0f}"
                     f"{f' ({before:.0f})' if before else ''} | {share} | {r['gib_read']:.2f} | "
                     f"{r['stored_layer_mib']:.0f} / {r['compute_layer_mib']:.0f} | {r['reconstruction_error']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/detjac-rehearsal"), help="where the checkpoints go")
    p.add_argument("--with-8b", action="store_true", help="also the 8B shape (21 minutes of 2 quiet cores)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--table", action="store_true",
                   help="print the results' table (docs/results/2026-11-28-layer-streamed-engine.md), then stop")
    p.add_argument("--again", nargs="+", default=[], metavar="RUN",
                   help="run these again (e.g. 1b-q4_0-float64), replacing their results")
    p.add_argument("_child", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        source, dtype, budget, tokens = args._child
        print(json.dumps(child(source, dtype, budget, int(tokens))), flush=True)
        return
    if args.table:
        print(table(json.loads(args.out.read_text())))
        return
    t0 = time.perf_counter()
    paths = checkpoints(args.work, args.with_8b)
    done: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    done.setdefault("runs", {})
    done["shape"] = {"1b": LLAMA32_1B, **({"8b": LLAMA31_8B} if args.with_8b else {}), "quant": QUANT}
    done["on_disk_mib"] = {k: sum(f.stat().st_size for f in (v.glob("*") if v.is_dir() else [v])) / 2**20
                           for k, v in paths.items()}
    print(f"checkpoints ready in {time.perf_counter() - t0:.0f} s: {done['on_disk_mib']}", flush=True)
    unknown = set(args.again) - {r[0] for r in runs(paths)}
    if unknown:
        raise SystemExit(f"Expected --again among {', '.join(r[0] for r in runs(paths))}. Got "
                         f"{', '.join(sorted(unknown))}.")
    for name, source, dtype, budget, tokens in runs(paths):
        if name in done["runs"] and name not in args.again:
            print(f"{name}: done already", flush=True)
            continue
        print(f"{name}: running", flush=True)
        proc = subprocess.run([sys.executable, "-m", __spec__.name, source, dtype, budget, str(tokens)],
                              capture_output=True, text=True, env={**os.environ, "THP_MEM_ALLOC_ENABLE": "1"})
        if proc.returncode != 0:
            print(f"{name} failed:\n{proc.stderr[-3000:]}", flush=True)
            continue
        done["runs"][name] = json.loads(proc.stdout.strip().splitlines()[-1])
        args.out.write_text(json.dumps(done, indent=1) + "\n")
        print(f"{name}: {json.dumps(done['runs'][name])}", flush=True)


if __name__ == "__main__":
    main()
