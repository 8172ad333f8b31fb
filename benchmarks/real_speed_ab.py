"""The two levers of real_speed.py measured in one process, interleaved: for a busy machine.

On a machine shared with other work, timings of separate processes minutes apart drift by more than the effects
measured. Here one process loads SmolLM2 (or Gemma 3) once, in memory and streamed, and runs the methods in turn,
round after round, so each round sees about the same load; reported are each method's median over the rounds, its
ratio to the reference's median, the seconds the streamed engine waited on weights, the peak RSS above the
run's start (``clear_refs``, as in real_speed.py) and the largest difference from the reference's J.

reference
    ``torch.autograd.functional.jacobian(vectorize=True)`` of the detached model.
memory, memory_unfolded, memory_64
    the in-memory engine as planned (all rows in one block where the MLPs fold), the same block never folded, and
    the plan before folding (blocks of 64 rows, unfolded).
streamed, streamed_sync, budgeted
    the layer-streamed engine reading ahead, reading each layer when asked (``SyncReader``: no overlap), and
    reading ahead under ``--max-memory cpu=300MiB``.

Results go to ``benchmarks/results/real_speed_ab.json`` keyed by model/tokens/dtype. Never a timed assertion.

    .venv/bin/python -m benchmarks.real_speed_ab --tokens 8 --dtype float64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from detjac.machine import cpu_name, peak_mib, reset_peak

from .support.shipped import shipped_gguf

RESULTS = Path(__file__).parent / "results" / "real_speed_ab.json"
BUDGET = "cpu=300MiB"  # as real_speed.py
TEXT = (Path(__file__).parent / "data" / "harbour.txt").read_text(encoding="utf-8").strip()  # as real_speed.py
METHODS = ("reference", "memory", "memory_unfolded", "memory_64", "streamed", "streamed_sync", "budgeted")


def runners(model: str, dtype: Any) -> dict[str, Any]:
    """One function of the token ids per method, each returning (J, seconds waited on weights)."""
    import torch

    from detjac.engine import assemble, load_engine
    from detjac.engine.detach.model import linearized
    from detjac.engine.pieces import fold
    from detjac.engine.streamed.prefetch import SyncReader
    from detjac.targets import OUTPUTS

    path = shipped_gguf(model)
    mem = load_engine(path, dtype=dtype)
    engines = {"streamed": load_engine(path, streamed=True, dtype=dtype),
               "streamed_sync": load_engine(path, streamed=True, dtype=dtype),
               "budgeted": load_engine(path, streamed=True, dtype=dtype, max_memory=BUDGET)}
    engines["streamed_sync"].skeleton.feed.reader = SyncReader(engines["streamed_sync"].skeleton.feed.reader.read)

    def reference(ids: list[int]) -> tuple[Any, float]:
        with linearized(mem.model) as lin:
            x = lin.decoder.get_input_embeddings()(torch.tensor([ids]))[0].detach()
            return torch.autograd.functional.jacobian(
                lambda e: lin.decoder(inputs_embeds=e[None], use_cache=False).last_hidden_state[0, -1], x,
                vectorize=True), 0.0

    def engine_run(engine: Any, mode: str = "auto", rows: int | None = None) -> Any:
        def run(ids: list[int]) -> tuple[Any, float]:
            stats = getattr(engine, "stats", None)
            waited = getattr(stats, "weight_wait_seconds", 0.0)
            with fold.folding(mode):
                trace = engine.trace(ids)
                J = assemble(engine, trace, [OUTPUTS], engine.plan(trace, [OUTPUTS], row_block=rows))[OUTPUTS]
            return J, getattr(stats, "weight_wait_seconds", 0.0) - waited
        return run

    return {"reference": reference, "memory": engine_run(mem), "memory_unfolded": engine_run(mem, "never"),
            "memory_64": engine_run(mem, "never", 64),
            **{name: engine_run(engine) for name, engine in engines.items()}}


def table(results: dict[str, Any]) -> str:
    """Each case's medians: seconds, ratio to the reference and, for the streamed engine, seconds waited on weights."""
    methods = [m for m in METHODS if any(m in c["methods"] for c in results["cases"].values())]
    lines = [f"{'case':<20} " + " ".join(f"{m:>16}" for m in methods) + "  waited s str/sync/bud"]
    for key, case in results["cases"].items():
        got = case["methods"]
        cells = [(f"{got[m]['median_seconds']:6.2f}" + (f" ({got[m]['ratio_to_reference']:.2f}x)"
                  if got[m]["ratio_to_reference"] is not None else "")) if m in got else "-" for m in methods]
        waited = "/".join(f"{got[m]['waited_on_weights']:.2f}" if m in got else "-"
                          for m in ("streamed", "streamed_sync", "budgeted"))
        lines.append(f"{key:<20} " + " ".join(f"{c:>16}" for c in cells) + f"  {waited}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--dtype", default="float64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--note", help="a note stored with the results (e.g. what else ran on the machine)")
    p.add_argument("--table", action="store_true", help="print the results table and stop")
    args = p.parse_args()
    if args.table:
        print(table(json.loads(RESULTS.read_text())))
        return
    import torch

    torch.set_num_threads(args.threads)
    from detjac.engine import load_engine

    tok = load_engine(shipped_gguf(args.model), streamed=True).tokenizer
    ids = list(tok(TEXT, add_special_tokens=True)["input_ids"][:args.tokens])
    run = runners(args.model, getattr(torch, args.dtype))
    methods = [m for m in METHODS if m in args.methods.split(",")]
    for m in methods:  # warm-up on 2 tokens: kernels, allocator
        run[m](ids[:2])
    times: dict[str, list[float]] = {m: [] for m in methods}
    waits: dict[str, list[float]] = {m: [] for m in methods}
    peaks: dict[str, float] = {m: 0.0 for m in methods}
    diffs: dict[str, float] = {}
    ref = None
    for r in range(args.rounds):
        for m in methods:
            base = reset_peak()
            t0 = time.perf_counter()
            J, waited = run[m](ids)
            times[m].append(time.perf_counter() - t0)
            waits[m].append(waited)
            peaks[m] = max(peaks[m], peak_mib() - base)
            if m == "reference" and ref is None:
                ref = J.double()
            if ref is not None:
                diffs[m] = float((J.double() - ref).abs().max() / ref.abs().max())
            print(f"round {r} {m}: {times[m][-1]:.2f} s, waited {waited:.2f} s", flush=True)
    med = {m: statistics.median(times[m]) for m in methods}
    record = {m: {"median_seconds": med[m], "seconds": times[m], "waited_on_weights": statistics.median(waits[m]),
                  "peak_mib": peaks[m], "max_rel_diff_from_reference": diffs.get(m),
                  "ratio_to_reference": med[m] / med["reference"] if "reference" in med else None}
              for m in methods}
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"cases": {}}
    results["machine"] = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads}
    if args.note:
        results["note"] = args.note
    results["cases"][f"{args.model}/{args.tokens}/{args.dtype}"] = {"rounds": args.rounds, "methods": record,
                                                                     "load_average": os.getloadavg()}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    for m in methods:
        c = record[m]
        ratio = f"{c['ratio_to_reference']:.2f}x" if c["ratio_to_reference"] is not None else "-"
        print(f"{m:<16} {c['median_seconds']:8.2f} s {ratio:>7}  waited {c['waited_on_weights']:6.2f} s  "
              f"peak +{c['peak_mib']:.0f} MiB  diff {c['max_rel_diff_from_reference']}")


if __name__ == "__main__":
    main()
