"""Exact attribution graphs on the two real trained models: time, memory, size, completeness, one run per case.

For SmolLM2-135M-Instruct and Gemma 3 270M (dequantized from their GGUF files), at 16 and 64 tokens of a fixed English
text, in float64 and float32, ``detjac.graphs.attribution_graph`` with its defaults (at most 7,500 neurons in the
adjacency, logits until 0.95 probability, circuit-tracer's pruning thresholds) on the in-memory engine; with
``--streamed`` also on the layer-streamed engine under a CPU budget. Each case runs in a fresh process: the model is
loaded, a 2-token graph is made first (kernels, allocator), the peak RSS is reset, then the timed graph. Reported:
seconds, peak RSS above the loaded model, active neurons, nodes before and after pruning, links kept, completeness
(the worst relative error of a node's incoming edges over every neuron against its value) and the share of each
logit the pruned graph carries.

Results go to ``benchmarks/results/graphs.json``, one record per case as it finishes; a rerun skips the cases
already there (``--redo`` recomputes them). Never a timed assertion: a report.

    .venv/bin/python -m benchmarks.graphs                                   # every case
    .venv/bin/python -m benchmarks.graphs --models smollm2 --tokens 16 --dtypes float64
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

from detjac.graph_settings import GraphSettings
from detjac.machine import cpu_name, peak_mib, reset_peak

from .support.shipped import SHIPPED, shipped_gguf

RESULTS = Path(__file__).parent / "results" / "graphs.json"
TEXT = (Path(__file__).parent / "data" / "harbour.txt").read_text(encoding="utf-8").strip()  # as real_speed.py


def _ids(engine: Any, n: int) -> list[int]:
    ids = engine.tokenizer(TEXT, add_special_tokens=True)["input_ids"]
    return list(ids[:n])


def one_case(model: str, tokens: int, dtype: str, engine_kind: str, budget: str | None) -> dict[str, Any]:
    """One graph in this process (see the module docstring)."""
    import numpy as np
    import torch

    from detjac.engine import load_engine
    from detjac.graphs import attribution_graph, graph_dict

    torch.set_num_threads(os.cpu_count() or 1)
    path = shipped_gguf(model)
    engine = load_engine(str(path), streamed=engine_kind == "streamed", dtype=getattr(torch, dtype),
                         max_memory=budget)
    attribution_graph(engine, _ids(engine, 2), GraphSettings(max_nodes=8))  # warm-up
    base = reset_peak()
    ids = _ids(engine, tokens)
    start = time.perf_counter()
    g = attribution_graph(engine, ids)
    seconds = time.perf_counter() - start
    peak = peak_mib() - base
    data = graph_dict(g, slug="bench", model=model)
    receiving = np.r_[np.arange(g.n_neurons), g.n_neurons + g.n_tokens + np.arange(g.n_logits)]
    return {
        "model": model, "tokens": len(ids), "dtype": dtype, "engine": engine_kind, "budget": budget,
        "seconds": round(seconds, 2), "peak_mib_above_model": round(peak, 1), "active_neurons": g.n_active,
        "neurons_in_adjacency": g.n_neurons, "logits": g.n_logits,
        "nodes_before_pruning": int(len(receiving) + g.n_tokens), "nodes_after_pruning": len(data["nodes"]),
        "links_after_pruning": len(data["links"]), "completeness_worst": float(g.worst_completeness),
        "logit_share_kept": [round(s, 4) for s in data["metadata"]["info"]["logit_share_kept"]],
        "top_logits": g.logit_tokens[:3], "top_probabilities": [round(float(p), 4) for p in g.logit_probabilities[:3]],
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def table(records: list[dict[str, Any]]) -> str:
    """The records as the markdown table of docs/graphs.md."""
    rows = ["| model | tokens | dtype | engine | seconds | peak RSS above model | nodes before → after pruning | links "
            "| completeness (worst) | share of the top logit kept |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["model"], r["tokens"], r["dtype"] != "float64", r["engine"])):
        engine = r["engine"] + (f" ({r['budget']})" if r.get("budget") else "")
        rows.append(f"| {r['model']} | {r['tokens']} | {r['dtype']} | {engine} | {r['seconds']:.0f} | "
                    f"{r['peak_mib_above_model'] / 1024:.2f} GiB | {r['nodes_before_pruning']:,} → "
                    f"{r['nodes_after_pruning']:,} | {r['links_after_pruning']:,} | {r['completeness_worst']:.1e} | "
                    f"{r['logit_share_kept'][0]:.2f} |")
    return "\n".join(rows)


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["model"], r["tokens"], r["dtype"], r["engine"], r.get("budget"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHIPPED), choices=SHIPPED)
    parser.add_argument("--tokens", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    parser.add_argument("--streamed", default=None, metavar="BUDGET",
                        help="Also run the layer-streamed engine under this --max-memory (e.g. cpu=2GiB).")
    parser.add_argument("--redo", action="store_true")
    parser.add_argument("--table", action="store_true", help="Print the results as a markdown table and stop.")
    parser.add_argument("--one", nargs=5, metavar=("MODEL", "TOKENS", "DTYPE", "ENGINE", "BUDGET"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, tokens, dtype, kind, budget = args.one
        print(json.dumps(one_case(model, int(tokens), dtype, kind, None if budget == "-" else budget)))
        return
    records = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    if args.table:
        print(table(records))
        return
    done = {_key(r) for r in records}
    cases = [(m, t, d, "memory", None) for m in args.models for t in args.tokens for d in args.dtypes]
    if args.streamed:
        cases += [(m, t, "float64", "streamed", args.streamed) for m in args.models for t in args.tokens]
    for model, tokens, dtype, kind, budget in cases:
        key = (model, tokens, dtype, kind, budget)
        if key in done and not args.redo:
            continue
        print(f"{time.strftime('%H:%M:%S')} {model} {tokens} tokens {dtype} {kind} {budget or ''}", flush=True)
        out = subprocess.run([sys.executable, "-m", __spec__.name, "--one", model, str(tokens), dtype, kind,
                              budget or "-"], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stderr[-2000:], flush=True)
            continue
        record = json.loads(out.stdout.strip().splitlines()[-1])
        records = [r for r in records if _key(r) != key] + [record]
        RESULTS.write_text(json.dumps(records, indent=1) + "\n")
        print(f"  {record['seconds']} s, peak +{record['peak_mib_above_model']} MiB, completeness "
              f"{record['completeness_worst']:.1e}, {record['nodes_after_pruning']} nodes kept", flush=True)


if __name__ == "__main__":
    main()
