"""What the folded MLPs (``engine/pieces/fold.py``) do to an attribution graph's time, on a real model.

A graph pulls its adjacency rows back through the layers below them in passes of ``rows_per_pass`` rows (128 without
a memory budget; with one, as many as the budget holds). A pass folds a layer's frozen MLP where that costs fewer
FLOPs than crossing it through its intermediate: more than ``d f / (2 f - d)`` rows (355 of SmolLM2's 576). For each
(rows per pass, fold mode) this runs ``detjac.graphs.attribution_graph`` in a fresh process (a 2-token graph first,
for kernels and allocator), times it, counts the MLP crossings that folded, and checks the graph's adjacency against
the first case's (the same graph up to rounding).

Results go to ``benchmarks/results/graph_fold.json``. Never a timed assertion: a report.

    .venv/bin/python -m benchmarks.graph_fold                    # SmolLM2, 16 tokens, float32: about 10 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from detjac.graph_settings import GraphSettings
from detjac.machine import cpu_name

from .support.shipped import SHIPPED, shipped_gguf

RESULTS = Path(__file__).parent / "results" / "graph_fold.json"
TEXT = (Path(__file__).parent / "data" / "harbour.txt").read_text(encoding="utf-8").strip()  # as graphs.py


def one(model: str, tokens: int, dtype: str, rows: int, mode: str, out: str) -> dict[str, Any]:
    """One timed graph in this process, the MLP crossings counted by whether they folded."""
    import numpy as np
    import torch

    from detjac.engine import load_engine
    from detjac.engine.pieces import fold, layer
    from detjac.graphs import attribution_graph

    torch.set_num_threads(os.cpu_count() or 1)
    engine = load_engine(str(shipped_gguf(model)), dtype=getattr(torch, dtype))
    ids = list(engine.tokenizer(TEXT, add_special_tokens=True)["input_ids"][:tokens])  # as graphs.py
    counts = {"folded": 0, "crossed": 0}
    pays = layer.fold_pays

    def counted(d: int, f: int, b: int) -> bool:
        got = pays(d, f, b)
        counts["folded" if got else "crossed"] += 1
        return got

    layer.fold_pays = counted
    with fold.folding(mode):
        attribution_graph(engine, ids[:2], GraphSettings(max_nodes=8, rows_per_pass=rows))  # warm-up
        counts.update(folded=0, crossed=0)
        start = time.perf_counter()
        g = attribution_graph(engine, ids, GraphSettings(rows_per_pass=rows))
        seconds = time.perf_counter() - start
    np.save(out, g.adjacency)
    return {"model": model, "tokens": len(ids), "dtype": dtype, "rows_per_pass": rows, "fold": mode,
            "seconds": round(seconds, 2), "mlp_crossings_folded": counts["folded"],
            "mlp_crossings_unfolded": counts["crossed"], "neurons_in_adjacency": g.n_neurons,
            "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=SHIPPED)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cases", default="128:auto,1024:never,1024:auto",
                   help="ROWS:MODE pairs, MODE among auto, never, always (default: %(default)s)")
    p.add_argument("--one", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        model, tokens, dtype, rows, mode, out = args.one
        print(json.dumps(one(model, int(tokens), dtype, int(rows), mode, out)))
        return
    import numpy as np

    work = Path(tempfile.mkdtemp(prefix="detjac-graph-fold-"))
    records, first = [], None
    for case in args.cases.split(","):
        rows, mode = case.split(":")
        out = work / f"{rows}-{mode}.npy"
        print(f"{time.strftime('%H:%M:%S')} {args.model} {args.tokens} tokens {args.dtype}, {rows} rows per pass, "
              f"fold {mode} ...", flush=True)
        proc = subprocess.run([sys.executable, "-m", __spec__.name, "--one", args.model, str(args.tokens), args.dtype,
                               rows, mode, str(out)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{case} failed:\n{proc.stderr[-3000:]}")
        record = json.loads(proc.stdout.strip().splitlines()[-1])
        adjacency = np.load(out)
        first = adjacency if first is None else first
        scale = float(np.abs(first).max())
        record["max_diff_from_first_case"] = float(np.abs(adjacency - first).max() / scale)
        records.append(record)
        print(f"  {record['seconds']} s; MLP crossings folded {record['mlp_crossings_folded']}, unfolded "
              f"{record['mlp_crossings_unfolded']}; adjacency differs from the first case's by "
              f"{record['max_diff_from_first_case']:.1e} of its largest entry", flush=True)
        RESULTS.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
