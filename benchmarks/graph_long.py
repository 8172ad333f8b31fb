"""A long prompt's attribution graph under a memory budget: measured in parts, extrapolated to the whole.

SmolLM2-135M-Instruct at ``--tokens`` (default 1,024) tokens of repeated English text, on the layer-streamed engine
under ``--max-memory`` (default ``cpu=2GiB``), float32 by default. The graph's parts are timed one by one: the
trace, the neurons' values, the ranking pullback (one row per logit through every layer, every neuron read), and
``--passes`` passes of the adjacency's cut pullbacks (``--rows`` rows each, seeded at neurons of the top layers,
the dearest); the whole graph's time is then the measured parts plus the adjacency's passes scaled to the 7,500
neurons of the default (each row's cost is proportional to the layers below its neuron). Peak RSS is measured over
the run. Results go to ``benchmarks/results/graph_long.json``.

    .venv/bin/python -m benchmarks.graph_long --tokens 1024 --max-memory cpu=2GiB
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from detjac.machine import cpu_name, peak_mib, reset_peak

from .support.shipped import shipped_gguf

RESULTS = Path(__file__).parent / "results" / "graph_long.json"
TEXT = (Path(__file__).parent / "data" / "harbour.txt").read_text(encoding="utf-8").strip()  # as real_speed.py


def main() -> None:
    import numpy as np
    import torch

    from detjac.engine import load_engine, neurons
    from detjac.engine.memory import return_freed_memory
    from detjac.graph_settings import LOGIT_PROBABILITY, MAX_LOGITS, MAX_NODES
    from detjac.graphs import adjacency as adj
    from detjac.graphs import targets as at

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--max-memory", default="cpu=2GiB")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--max-nodes", type=int, default=MAX_NODES)
    args = parser.parse_args()
    return_freed_memory()
    engine = load_engine(str(shipped_gguf("smollm2")), streamed=True, dtype=getattr(torch, args.dtype),
                         max_memory=args.max_memory)
    ids = engine.tokenizer(TEXT * 20, add_special_tokens=True)["input_ids"][:args.tokens]
    base = reset_peak()
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    trace = engine.trace(ids)
    times["trace"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    targets = at.logit_targets(engine, trace.output, MAX_LOGITS, LOGIT_PROBABILITY)
    acts = {layer: z for layer, z, _ in neurons(engine, trace)}
    times["neurons"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    chosen, n_active, _ = at.rank_neurons(engine, trace, targets, acts, args.max_nodes)
    times["rank"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sites = adj.neuron_sites(engine, trace, chosen, acts)
    times["sites"] = time.perf_counter() - t0
    L = engine.n_layers
    top = chosen[np.argsort(-chosen[:, 0].numpy(), kind="stable")][:args.rows * args.passes]
    passes = adj.cut_pullbacks(top, targets, _subset(sites, chosen, top), args.rows, trace.n_tokens, L)
    t0 = time.perf_counter()
    rows_done, layer_rows = 0, 0
    for requests, _ in passes[:args.passes]:
        for _ in engine.pulls(trace, requests):
            pass
        rows_done += sum(r.rows for r in requests)
        layer_rows += sum(r.rows * (min(r.top, L - 1) + 1) for r in requests)
    measured = time.perf_counter() - t0
    per_layer_row = measured / max(layer_rows, 1)
    all_layer_rows = int(sum(int(layer) + 1 for layer in chosen[:, 0])) + len(targets.ids) * L
    record = {
        "model": "smollm2", "tokens": len(ids), "dtype": args.dtype, "budget": args.max_memory,
        "active_neurons": n_active, "neurons_in_adjacency": int(chosen.shape[0]),
        "seconds": {k: round(v, 2) for k, v in times.items()},
        "adjacency_rows_measured": rows_done, "adjacency_seconds_measured": round(measured, 2),
        "seconds_per_row_layer": round(per_layer_row, 4),
        "adjacency_seconds_extrapolated": round(per_layer_row * all_layer_rows, 1),
        "whole_graph_seconds_extrapolated": round(sum(times.values()) + per_layer_row * all_layer_rows, 1),
        "peak_mib_above_model": round(peak_mib() - base, 1), "cpu": cpu_name(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


def _subset(sites, chosen, top):  # the read and write rows of the neurons in ``top`` (rows of ``chosen``)
    import torch

    from detjac.graphs.adjacency import Sites

    reads, writes = {}, {}
    for layer in {int(v) for v in top[:, 0]}:
        rows = (chosen[:, 0] == layer).nonzero().reshape(-1)
        keep = torch.tensor([bool(((top == chosen[r]).all(1)).any()) for r in rows.tolist()])
        reads[layer], writes[layer] = sites.reads[layer][keep], sites.writes[layer][keep]
    return Sites(reads, writes, sites.outputs, [])


if __name__ == "__main__":
    main()
