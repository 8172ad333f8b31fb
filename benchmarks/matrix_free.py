"""Matrix-free top-16 SVD of the detached Jacobian against forming J and taking its SVD, in one run.

One model: a random Llama (d_model 512, 4 layers, ffn 1376, 8 query / 4 key-value heads of
64, vocabulary 1000, weights perturbed by 0.02), float64 on CPU, 2 threads. For each prompt
length (64, 256 and 1024 random tokens by default), two fresh processes:

formed
    The in-memory row-block engine (``detached_jacobian``, row_block 64: the CLI's default)
    forms J (d x n d), then ``torch.linalg.svd`` gives its top 16 triplets
    (:func:`detjac.engine.products.decode.dense_svd`, what ``detjac jacobian`` and the demo use).
matrix-free
    :class:`detjac.engine.products.linear_operator.ModelOperator` (the forward pass and its pullback once,
    products in blocks of at most 64 columns) and :func:`detjac.engine.products.lanczos.operator_svd`
    (block Lanczos, block 8, residual tolerance 1e-8 of sigma_1, final residuals verified by
    explicit products).

Reported per length: wall time, peak RSS above the loaded and warmed-up model (VmHWM, read in
each child), the products used, and the largest relative difference of the 16 singular values
(the formed path's full SVD as the reference); then the ratios formed / matrix-free. Never a
timed assertion: this is a report (``benchmarks/results/matrix_free.json``).

    .venv/bin/python -m benchmarks.matrix_free                    # 64, 256 and 1024 tokens
    .venv/bin/python -m benchmarks.matrix_free --tokens 64 --quick  # a smaller model, to check the script
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

from detjac.machine import peak_mib

RESULTS = Path(__file__).parent / "results" / "matrix_free.json"
MODEL = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=1000)
QUICK = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=1000)
K = 16


def _setup(cfg: dict[str, Any], n: int) -> tuple[Any, list[int]]:
    import torch

    from detjac.engine.checkpoints.tiny import tiny_model

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model = tiny_model("llama", dtype=torch.float64, scale=0.02, max_position_embeddings=max(n, 64), **cfg)
    ids = torch.randint(3, cfg["vocab_size"], (n,), generator=torch.Generator().manual_seed(0)).tolist()
    return model, ids


def child_formed(cfg: dict[str, Any], n: int, out: str) -> dict[str, Any]:
    import torch

    from detjac.engine import InMemoryEngine, jacobian
    from detjac.engine.products.decode import dense_svd

    model, ids = _setup(cfg, n)
    dense_svd(jacobian(InMemoryEngine(model), ids[:4]).combined(), K)  # warm up kernels and allocator
    base = peak_mib()
    t0 = time.perf_counter()
    res = jacobian(InMemoryEngine(model), ids, row_block=64)
    t_form = time.perf_counter() - t0
    svd = dense_svd(res.combined(), K, orient=res.produced)
    seconds = time.perf_counter() - t0
    rss = peak_mib() - base
    torch.save({"S": svd.S, "U": svd.U}, out)
    return {"seconds": seconds, "form_seconds": t_form, "svd_seconds": seconds - t_form, "rss_above_weights_mib": rss,
            "products": res.jacobian.shape[0], "jacobian_mib": res.jacobian.numel() * 8 / 2**20,
            "reconstruction_error": res.reconstruction_error}


def child_matrix_free(cfg: dict[str, Any], n: int, out: str) -> dict[str, Any]:
    import torch

    from detjac.engine.products.lanczos import operator_svd
    from detjac.engine.products.linear_operator import ModelOperator

    model, ids = _setup(cfg, n)
    operator_svd(ModelOperator(model, ids[:4]), 2)  # warm up kernels and allocator
    base = peak_mib()
    t0 = time.perf_counter()
    op = ModelOperator(model, ids)
    t_build = time.perf_counter() - t0
    svd = operator_svd(op, K, block=8, tol=1e-8, orient=op.produced)
    seconds = time.perf_counter() - t0
    rss = peak_mib() - base
    err = op.check()  # after the measurement: one more product
    torch.save({"S": svd.S, "U": svd.U}, out)
    return {"seconds": seconds, "build_seconds": t_build, "iteration_seconds": seconds - t_build,
            "rss_above_weights_mib": rss, "products": svd.products, "matvecs": svd.matvecs, "rmatvecs": svd.rmatvecs,
            "iterations": svd.iterations, "basis": svd.basis, "max_residual": float(svd.residuals.max()),
            "converged": svd.converged, "sweeps": op.stats.sweeps, "reconstruction_error": err}


def _run_child(kind: str, cfg: dict[str, Any], n: int, out: Path) -> dict[str, Any]:
    load = os.getloadavg()[0]  # the machine is shared: say how busy it was
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "_child", kind, json.dumps(cfg), str(n), str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child {kind} at {n} tokens failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "load_average_1min_before": load}


def measure(cfg: dict[str, Any], n: int, tmp: Path) -> dict[str, Any]:
    import torch

    mf = _run_child("matrix_free", cfg, n, tmp / f"mf{n}.pt")
    formed = _run_child("formed", cfg, n, tmp / f"formed{n}.pt")
    a, b = torch.load(tmp / f"mf{n}.pt"), torch.load(tmp / f"formed{n}.pt")
    rel = ((a["S"] - b["S"]).abs() / b["S"]).max()
    cos = torch.linalg.svdvals(a["U"].T @ b["U"]).min()  # the top-16 left subspaces
    mf_rss = max(mf["rss_above_weights_mib"], 1e-9)
    row = {"tokens": n, "matrix_free": mf, "formed": formed, "max_rel_sigma_error": float(rel),
           "min_cos_left_subspace": float(cos), "time_ratio_formed_over_matrix_free": formed["seconds"] / mf["seconds"],
           "rss_ratio_formed_over_matrix_free": formed["rss_above_weights_mib"] / mf_rss,
           "product_ratio_formed_over_matrix_free": formed["products"] / mf["products"]}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        kind, cfg, n, out = sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        fn = child_formed if kind == "formed" else child_matrix_free
        print(json.dumps(fn(cfg, n, out)))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--quick", action="store_true", help="a d_model 128, 2-layer model (checks that the script runs)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    cfg = QUICK if args.quick else MODEL
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(cfg, n, Path(tmp)) for n in args.tokens]
    results = {"model": {"model_type": "llama", **cfg, "dtype": "float64", "weights": "random, scale 0.02"},
               "k": K, "matrix_free": {"method": "lanczos", "block": 8, "tol": 1e-8, "product_block": 64},
               "formed": {"row_block": 64, "svd": "torch.linalg.svd (full_matrices=False)"},
               "machine": {"threads": int(os.environ.get("BENCH_THREADS", "2")), "python": sys.version.split()[0],
                           "load_average_at_end": os.getloadavg()},
               "runs": rows, "total_seconds": time.perf_counter() - t0}
    if not args.quick:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")
    _table(rows)


def _table(rows: list[dict[str, Any]]) -> None:
    print(f"{'tokens':>6}  {'formed: s':>10} {'MiB':>8}  {'matrix-free: s':>14} {'MiB':>7} {'products':>8}  "
          f"{'time x':>6} {'memory x':>8}  {'max rel err':>11}")
    for r in rows:
        f, m = r["formed"], r["matrix_free"]
        print(f"{r['tokens']:>6}  {f['seconds']:>10.1f} {f['rss_above_weights_mib']:>8.0f}  {m['seconds']:>14.1f} "
              f"{m['rss_above_weights_mib']:>7.0f} {m['products']:>8}  {r['time_ratio_formed_over_matrix_free']:>6.2f} "
              f"{r['rss_ratio_formed_over_matrix_free']:>8.2f}  {r['max_rel_sigma_error']:>11.1e}")


if __name__ == "__main__":
    main()
