"""The row block the engine picks when none is given, against a sweep of fixed sizes (issue 67, item 1).

For each case one process loads the model once and times the detached Jacobian of one prompt
(``detjac.engine.jacobian``: trace, row blocks, exactness check: what ``detjac jacobian`` times) with each row block
of the sweep and with the default (``row_block=None``: the engine's cost model decides), round after round, the
order reversed every other round, so that every size sees about the same load on a shared machine. Reported per
case: each size's median seconds, the best fixed size, and the default's median over the best one's (the issue asks
for at most 1.10).

Cases
-----
smollm2/gemma3 x float32/float64 x 8/32 tokens
    The shipped GGUF files (SmolLM2-135M, d 576; Gemma 3 270M, d 640), in memory, as ``detjac jacobian MODEL.gguf
    --dtype ...`` runs them; sweep 64 (the former default), 128 and 288 rows (the largest block below d that the
    MLPs do not fold in) and all d rows (``whole``).
llama1b/float32/N
    Llama-3.2-1B's shape (d 2048, 16 layers, ffn 8192, 32/8 heads of 64; random bf16 weights written once to a
    cache folder; vocabulary cut to 32k, which changes no sweep), layer-streamed under ``--max-memory cpu=1GiB``,
    as ``detjac jacobian FOLDER --max-memory cpu=1GiB --dtype float32`` runs it; sweep 64, 128, 256 rows (every
    block one more pass over the 16 layers' weights), at N tokens (``--cases llama1b/float32/4``; fewer than the
    others: its sweep takes minutes per block size on 2 cores).

Results: ``benchmarks/results/row_block_default.json``, keyed by case, written after every measurement (an
interrupted run resumes where it stopped). Never a timed assertion.

    .venv/bin/python -m benchmarks.row_block_default --rounds 2
    .venv/bin/python -m benchmarks.row_block_default --cases smollm2/float32/8 --rounds 3
    .venv/bin/python -m benchmarks.row_block_default --table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from detjac.machine import available_memory, cpu_name

from .support.shipped import shipped_gguf

RESULTS = Path(__file__).parent / "results" / "row_block_default.json"
TEXT = (Path(__file__).parent / "data" / "harbour.txt").read_text(encoding="utf-8").strip()
SWEEP = (64, 128, 288)  # plus "whole" (d rows) and "default" (None); --sweep sets others
SWEEP_1B = (64, 128, 256)
BUDGET_1B = "cpu=1GiB"
LLAMA_1B = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=32000,
                tie_word_embeddings=True, max_position_embeddings=2048)
CACHE_1B = Path("/tmp/detjac-bench-llama1b-shape")
CASES = [f"{m}/{t}/{n}" for m in ("smollm2", "gemma3") for t in ("float32", "float64") for n in (8, 32)]


def load_case(case: str, sweep: tuple[int, ...] = SWEEP) -> tuple[Any, list[int], list[int | None]]:
    """The engine of ``case``, its prompt's token ids and the row blocks to time (None: the default)."""
    from detjac.engine import load_engine

    model, dtype, n = case.split("/")
    if model == "llama1b":
        import torch

        from .support.random_weights import write_random_checkpoint

        if not (CACHE_1B / "model.safetensors.index.json").is_file():
            write_random_checkpoint(CACHE_1B, LLAMA_1B, torch.bfloat16)
        engine = load_engine(CACHE_1B, streamed=True, dtype=dtype, max_memory=BUDGET_1B)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, LLAMA_1B["vocab_size"], (int(n),), generator=gen).tolist()
        return engine, ids, [*SWEEP_1B, None]
    engine = load_engine(shipped_gguf(model), dtype=dtype)
    ids = list(engine.tokenizer(TEXT)["input_ids"][:int(n)])
    return engine, ids, [*sweep, engine.d_model, None]


def label(block: int | None, d: int) -> str:
    return "default" if block is None else "whole" if block == d else str(block)


def run_case(case: str, rounds: int, results: dict[str, Any], sweep: tuple[int, ...] = SWEEP) -> None:
    """Time every block of ``case`` ``rounds`` times, interleaved; measurements already in ``results`` are kept."""
    import torch

    from detjac.engine import jacobian

    engine, ids, blocks = load_case(case, sweep)
    d = engine.d_model
    record = results["cases"].setdefault(case, {"runs": []})
    record.update({"d_model": d, "tokens": len(ids), "threads": torch.get_num_threads()})
    done = {(r["block"], r["round"]) for r in record["runs"]}
    jacobian(engine, ids[:2])  # warm up: kernels, allocator, the first layers read
    for r in range(rounds):
        for block in blocks if r % 2 == 0 else blocks[::-1]:
            name = label(block, d)
            if (name, r) in done:
                continue
            load = os.getloadavg()[0]
            t0, c0 = time.perf_counter(), time.process_time()
            res = jacobian(engine, ids, row_block=block)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            record["runs"].append({"block": name, "round": r, "seconds": seconds, "cpu_seconds": cpu,
                                   "row_block": res.row_block,
                                   "row_blocks": -(-d // res.row_block), "load_average": load,
                                   "reconstruction_error": res.reconstruction_error})
            print(f"{case} round {r} {name:>7} ({res.row_block} rows): {seconds:7.2f} s, {cpu:7.2f} s CPU, load "
                  f"{load:.1f}",
                  flush=True)
            summarize(record)
            save(results)


def summarize(record: dict[str, Any]) -> None:
    """Each size's median (wall and CPU seconds: on a shared machine CPU time is the steadier measure of the work),
    the best fixed size and the default's ratio to it."""
    for unit, field in (("", "seconds"), ("_cpu", "cpu_seconds")):
        by: dict[str, list[float]] = {}
        for r in record["runs"]:
            by.setdefault(r["block"], []).append(r[field])
        med = {k: statistics.median(v) for k, v in by.items()}
        fixed = {k: v for k, v in med.items() if k != "default"}
        record[f"median{unit}_seconds"] = med
        record[f"spread{unit}"] = {k: (max(v) - min(v)) / statistics.median(v) for k, v in by.items() if len(v) > 1}
        if fixed and "default" in med:
            best = min(fixed, key=fixed.__getitem__)
            record[f"best{unit}"], record[f"default_over_best{unit}"] = best, med["default"] / fixed[best]
    record["default_rows"] = next((r["row_block"] for r in record["runs"] if r["block"] == "default"), None)


def save(results: dict[str, Any]) -> None:
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(RESULTS)


def table(results: dict[str, Any]) -> str:
    """One markdown row per case: median wall seconds (CPU seconds) per block size, the default's rows, the best
    fixed size by CPU time and the default's ratio to the best (wall; CPU)."""
    cols = [c for c in ("32", "64", "128", "192", "256", "288", "whole", "default")
            if any(c in rec.get("median_seconds", {}) for rec in results["cases"].values())]
    lines = ["| case | " + " | ".join(cols) + " | default rows | best | default / best |",
             "|---" * (len(cols) + 4) + "|"]
    for case, rec in results["cases"].items():
        med, cpu = rec.get("median_seconds", {}), rec.get("median_cpu_seconds", {})
        cells = [f"{med[c]:.1f} ({cpu[c]:.1f})" if c in med else "–" for c in cols]
        wall, on_cpu = rec.get("default_over_best"), rec.get("default_over_best_cpu")
        ratio = "–" if wall is None else f"{wall:.2f}; {on_cpu:.2f}"
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {rec.get('default_rows', '–')} | "
                     f"{rec.get('best_cpu', '–')} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated; llama1b/float32/N for the 1B shape")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sweep", help="comma-separated fixed row blocks for the real models (default: "
                                   f"{','.join(map(str, SWEEP))}; whole and default always run)")
    p.add_argument("--note", help="stored with the results (e.g. what else ran on the machine)")
    p.add_argument("--table", action="store_true", help="print the results table and stop")
    args = p.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"cases": {}}
    if args.table:
        print(table(results))
        return
    results.update({"cpu": cpu_name(), "cpus": os.cpu_count(),
                    "available_memory_gib": (available_memory() or 0) / 2**30})
    if args.note:
        results["note"] = args.note
    sweep = tuple(int(b) for b in args.sweep.split(",")) if args.sweep else SWEEP
    for case in args.cases.split(","):
        run_case(case, args.rounds, results, sweep)
    print(table(results))


if __name__ == "__main__":
    main()
