"""Out-of-core SVD from a store on a memory-limited dask LocalCluster, against in-memory numpy.

Builds a store of real float64 Jacobians of the default model whose total size is at least
``--factor`` times the workers' combined ``memory_limit`` (the few real Jacobians are
written under many distinct prompt texts, which the output says), then computes the top-k
singular values of the corpus operator ``[C_1 ... C_P]`` (every prompt's combined operator
side by side, rows x sum of n_p * d) on the cluster from the Gram matrix ``A A^T`` (rows x
rows), streamed chunk by chunk (``svd_compressed`` on this short, wide operator keeps
``A^T Q``, as large as a tenth of the data, in memory and got workers restarted at these
limits). Then, on a subset that fits in memory, numpy's full SVD against both dask
methods, in the same run.

    .venv/bin/python -m benchmarks.analysis_ooc            # ~3 minutes on 2 cores
    .venv/bin/python -m benchmarks.analysis_ooc --quick
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def real_jacobians(count: int) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """(text, J, embeddings, output) of the first ``count`` held-out prompts, float64."""
    import torch

    from detjac.engine import InMemoryEngine, jacobian, load_model

    model = load_model("default")
    texts = (HERE / "data" / "heldout_prompts.txt").read_text().splitlines()[:count]
    out = []
    for text in texts:
        res = jacobian(InMemoryEngine(model), text)
        out.append((text, res.jacobian.numpy(), res.embeddings.numpy(), res.output.numpy()))
    del torch
    return out


def build_store(path: Path, jacobians: list, target_bytes: int) -> tuple[int, int]:
    """Write copies of the real Jacobians until ``target_bytes``; returns (prompts, bytes)."""
    from detjac.store import create_store

    run = {"model_id": "gcide-llama", "dtype": "float64", "keep": "full", "row_block": 64}
    total, i = 0, 0
    with create_store(path, run) as store:
        while total < target_bytes:
            text, J, x, y = jacobians[i % len(jacobians)]
            with store.begin(f"p{i:05d}", n_rows=J.shape[0], n_tokens=J.shape[1], n_cols=J.shape[2],
                             dtype="float64", row_block=64) as w:
                for start in range(0, J.shape[0], 64):
                    w.write_rows(start, start + 64, J[start:start + 64])
                w.write_array("embeddings", x)
                w.write_array("output", y)
                w.write_array("token_ids", np.arange(J.shape[1]))
                w.commit({"prompt": f"{text} #{i}", "n_tokens": J.shape[1], "reconstruction_error": 0.0,
                          "dtype": "float64"})
            total += J.nbytes
            i += 1
    return i, total


def corpus_operator(store, ids):
    import dask.array as da

    from detjac.analysis.spectra import operator

    return da.concatenate([operator(store.get(pid), None) for pid in ids], axis=1)


def timed(func):
    started = time.perf_counter()
    value = func()
    return value, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--memory-limit", default="256MiB")
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--power-iterations", type=int, default=6)
    p.add_argument("--subset", type=int, default=8, help="prompts in the in-memory comparison")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=HERE / "results" / "analysis_ooc.json")
    args = p.parse_args()
    import dask.array as da
    from dask.utils import parse_bytes
    from distributed import Client, LocalCluster

    from detjac.analysis.spectra import gram_spectrum
    from detjac.store import open_store

    limit = parse_bytes(args.memory_limit)
    target = int(args.factor * args.workers * limit) if not args.quick else 64 * 2**20
    folder = Path(tempfile.mkdtemp(prefix="detjac-ooc-"))
    try:
        jac, t_engine = timed(lambda: real_jacobians(8))
        (n_prompts, nbytes), t_write = timed(lambda: build_store(folder / "s.zarr", jac, target))
        store = open_store(folder / "s.zarr")
        ids = store.prompt_ids()
        print(f"store: {n_prompts} prompts ({len(jac)} real float64 Jacobians of the default model, repeated), "
              f"{nbytes / 2**30:.2f} GiB of Jacobians = {nbytes / (args.workers * limit):.1f}x the workers' "
              f"{args.workers} x {args.memory_limit}; written in {t_write:.0f} s (engine {t_engine:.0f} s)")
        with LocalCluster(n_workers=args.workers, threads_per_worker=1, memory_limit=args.memory_limit,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            print(f"LocalCluster: {args.workers} workers x {args.memory_limit}, dashboard {client.dashboard_link}")
            A = corpus_operator(store, ids)
            before = set(client.scheduler_info()["workers"])
            s, t_svd = timed(lambda: gram_spectrum(A, args.k))
            workers = client.scheduler_info()["workers"]
            peak = max(w["metrics"]["memory"] for w in workers.values())
            restarts = len(before - set(workers))  # a restarted worker comes back under a new address
        print(f"corpus operator {A.shape[0]} x {A.shape[1]:,} ({A.nbytes / 2**30:.2f} GiB), k={args.k}, "
              f"{args.power_iterations} power iterations")
        print(f"  top-{args.k} singular values from the streamed Gram A A^T on the cluster (method 'gram'): "
              f"{t_svd:.1f} s; sigma_1..3 = {', '.join(f'{v:.4g}' for v in s[:3])}")
        print(f"  worker memory at the end: {peak / 2**20:.0f} MiB (limit {args.memory_limit}), worker restart "
              f"events: {restarts}")
        sub = corpus_operator(store, ids[: args.subset])
        dense = sub.compute()
        (_, s_np, _), t_np = timed(lambda: np.linalg.svd(dense, full_matrices=False))
        s_gram, t_gram = timed(lambda: gram_spectrum(sub, args.k))
        (_, s_rand, _), t_rand = timed(lambda: da.compute(*da.linalg.svd_compressed(
            sub, args.k, n_power_iter=args.power_iterations, seed=0), scheduler="threads"))
        top = s_np[: args.k]
        gram_err, rand_err = float(np.max(np.abs(s_gram - top) / top)), float(np.max(np.abs(s_rand - top) / top))
        print(f"subset of {args.subset} prompts ({dense.nbytes / 2**20:.0f} MiB, fits in memory), top-{args.k}:")
        print(f"  numpy full SVD {t_np:.2f} s | dask gram {t_gram:.2f} s (ratio {t_np / t_gram:.1f}x, max rel. error "
              f"{gram_err:.1e}) | dask svd_compressed, {args.power_iterations} power iterations {t_rand:.2f} s "
              f"(ratio {t_np / t_rand:.1f}x, max rel. error {rand_err:.1e})")
        result = {"prompts": n_prompts, "jacobian_gib": nbytes / 2**30, "workers": args.workers,
                  "memory_limit": args.memory_limit, "k": args.k, "power_iterations": args.power_iterations,
                  "gram_seconds_cluster": t_svd, "peak_worker_mib": peak / 2**20, "worker_restarts": restarts,
                  "subset_prompts": args.subset, "numpy_seconds": t_np, "gram_seconds": t_gram,
                  "gram_max_rel_error": gram_err, "svd_compressed_seconds": t_rand, "svd_compressed_max_rel_error":
                  rand_err}
        if not args.quick:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
            print(f"wrote {args.out}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
