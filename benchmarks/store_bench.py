"""How fast and how small is the Jacobian store? Write throughput, compression and read latency, in one run.

All measurements use real detached Jacobians of the shipped trained model (``gcide-llama``,
d_model = 256) on prompts from ``benchmarks/data/heldout_prompts.txt``, and one temporary
folder, so every number is taken on the same disk:

1. **Write throughput.** The Jacobians are computed first (the engine is not timed) and then
   written (a) through the store's writer API and (b) with ``numpy.save`` (one ``.npy`` per
   array, ``os.fsync`` of every file and of the folder, since the store fsyncs on commit; an
   unsynced ``numpy.save`` is shown as well). MB/s is uncompressed bytes / seconds.
2. **Compression ratio** of float64 and float32 Jacobians: uncompressed bytes / bytes of the
   files under ``<store>/prompts`` (blosc zstd level 3, byte shuffle, crc32c, sharded).
3. **Read latency.** A store of ``--read-prompts`` prompts (the same few real Jacobians
   written under distinct prompt texts ``"<text> #<i>"``) is opened anew in a fresh Python
   process, which times ``open_store(path).prompt_ids()`` and ``store.get(pid).operator(k)``
   for seeded random ``(pid, k)`` pairs.

    .venv/bin/python -m benchmarks.store_bench            # ~3-5 minutes on 2 cores
    .venv/bin/python -m benchmarks.store_bench --quick    # smoke test, seconds
    .venv/bin/python -m benchmarks.store_bench --dir /mnt/data --prompts 100

Prints a table and writes ``benchmarks/results/store_bench.json`` (not in ``--quick`` mode
unless ``--out`` is given). The operating system's page cache is not dropped, so reads are
warm-cache reads; the numbers also depend on whatever else runs on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from detjac.store import create_store, open_store, prompt_id

HERE = Path(__file__).resolve().parent
MB = 1e6
FSYNC_NOTE = ("numpy: np.save per array + os.fsync of every file + fsync of the prompt folder; "
              "store: its own commit (fsync of every file, rename, fsync of prompts/)")


@dataclass
class Sample:
    """One prompt's Jacobian and small arrays, as numpy (storage dtype)."""

    text: str
    jacobian: np.ndarray  # (rows, n_tokens, d)
    embeddings: np.ndarray  # (n_tokens, d)
    output: np.ndarray  # (rows,)
    token_ids: np.ndarray  # (n_tokens,) int64

    @property
    def nbytes(self) -> int:
        return self.jacobian.nbytes + self.embeddings.nbytes + self.output.nbytes + self.token_ids.nbytes


def read_prompts(path: Path, n: int) -> list[str]:
    """The first ``n`` non-blank lines of ``path``."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if len(lines) < n:
        raise SystemExit(f"Expected at least {n} prompts in {path}. Got {len(lines)}.")
    return lines[:n]


def compute_samples(texts: list[str], dtype: str, row_block: int) -> tuple[list[Sample], float]:
    """Detached Jacobians of the default model in ``dtype``; returns the samples and engine seconds."""
    import torch

    from detjac.engine import InMemoryEngine, load_model
    from detjac.engine.checkpoints.default import default_model_dir
    from detjac.targets import OUTPUTS

    engine = InMemoryEngine(load_model(default_model_dir(), dtype=getattr(torch, dtype)))
    started = time.perf_counter()
    samples = []
    for text in texts:
        trace = engine.trace(text)
        plan = engine.plan(trace, [OUTPUTS], row_block=row_block)
        blocks = [block.values.numpy() for block in engine.blocks(trace, [OUTPUTS], plan)]
        samples.append(Sample(text, np.concatenate(blocks, axis=0), trace.embeddings.numpy(),
                              trace.output.numpy(), np.asarray(trace.token_ids, dtype=np.int64)))
    return samples, time.perf_counter() - started


def run_description(dtype: str, row_block: int) -> dict[str, Any]:
    """A run description like ``detjac run`` writes for the default model."""
    return {"model_id": "gcide-llama", "model_type": "llama", "config_sha256": "store-bench", "revision": None,
            "dtype": dtype, "keep": "full", "detach": True, "position": -1, "target": "hidden",
            "row_block": row_block}


def write_prompt(store: Any, run: dict[str, Any], text: str, sample: Sample) -> str:
    """Write one prompt through the writer API, row block by row block; returns its id."""
    rows, n, d = sample.jacobian.shape
    step = run["row_block"]
    pid = prompt_id(run, text)
    with store.begin(pid, n_rows=rows, n_tokens=n, n_cols=d, dtype=run["dtype"], row_block=step) as writer:
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            writer.write_rows(start, stop, sample.jacobian[start:stop])
        writer.write_array("embeddings", sample.embeddings)
        writer.write_array("output", sample.output)
        writer.write_array("token_ids", sample.token_ids)
        writer.commit({"prompt": text, "n_tokens": n, "reconstruction_error": 0.0, "dtype": run["dtype"]})
    return pid


def write_store(path: Path, run: dict[str, Any], samples: list[Sample], texts: list[str] | None = None) -> float:
    """Create a store at ``path`` and write ``samples`` (under ``texts`` if given); returns seconds."""
    texts = texts or [s.text for s in samples]
    started = time.perf_counter()
    with create_store(path, run) as store:
        for i, text in enumerate(texts):
            write_prompt(store, run, text, samples[i % len(samples)])
    return time.perf_counter() - started


def fsync_path(path: Path) -> None:
    """``os.fsync`` of a file or folder."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_numpy(folder: Path, samples: list[Sample], fsync: bool) -> float:
    """``numpy.save`` every array of every sample into ``folder/<i>/``; returns seconds."""
    started = time.perf_counter()
    for i, sample in enumerate(samples):
        sub = folder / f"{i:05d}"
        sub.mkdir(parents=True)
        for name in ("jacobian", "embeddings", "output", "token_ids"):
            target = sub / f"{name}.npy"
            np.save(target, getattr(sample, name))
            if fsync:
                fsync_path(target)
        if fsync:
            fsync_path(sub)
    if fsync:
        fsync_path(folder)
    return time.perf_counter() - started


def tree_bytes(path: Path) -> tuple[int, int]:
    """(sum of file sizes, number of files) under ``path``."""
    total = count = 0
    for folder, _, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(folder, name))
            count += 1
    return total, count


def throughput(work: Path, samples: list[Sample], rounds: int, row_block: int) -> dict[str, Any]:
    """Store vs numpy.save write speed over ``rounds`` alternating rounds; keeps round 0's store."""
    run = run_description(str(samples[0].jacobian.dtype), row_block)
    write_store(work / "warmup.zarr", run, samples[:1])  # imports, codec set-up: not timed
    save_numpy(work / "warmup-npy", samples[:1], fsync=True)
    seconds: dict[str, list[float]] = {"store": [], "numpy_fsync": [], "numpy_nofsync": []}
    for r in range(rounds):
        seconds["store"].append(write_store(work / f"tp-{r}.zarr", run, samples))
        seconds["numpy_fsync"].append(save_numpy(work / f"tp-{r}-npy", samples, fsync=True))
        seconds["numpy_nofsync"].append(save_numpy(work / f"tp-{r}-npy-nofsync", samples, fsync=False))
        for name in (f"tp-{r}-npy", f"tp-{r}-npy-nofsync") + ((f"tp-{r}.zarr",) if r else ()):
            shutil.rmtree(work / name)
    nbytes = sum(s.nbytes for s in samples)
    speed = {key: [nbytes / t / MB for t in values] for key, values in seconds.items()}
    median = {key: float(np.median(values)) for key, values in speed.items()}
    return {"prompts": len(samples), "rounds": rounds, "uncompressed_bytes": nbytes, "seconds": seconds,
            "mb_per_s": speed, "median_mb_per_s": median, "fsync": FSYNC_NOTE,
            "ratio_store_to_numpy_fsync": median["store"] / median["numpy_fsync"],
            "ratio_store_to_numpy_nofsync": median["store"] / median["numpy_nofsync"],
            "store_path": str(work / "tp-0.zarr")}


def compression(store: Path, samples: list[Sample]) -> dict[str, Any]:
    """Uncompressed bytes of ``samples`` / bytes of the files under ``store/prompts``."""
    disk, files = tree_bytes(store / "prompts")
    raw = sum(s.nbytes for s in samples)
    jac = sum(s.jacobian.nbytes for s in samples)
    tokens = [s.jacobian.shape[1] for s in samples]
    return {"dtype": str(samples[0].jacobian.dtype), "prompts": len(samples), "uncompressed_bytes": raw,
            "jacobian_bytes": jac, "disk_bytes": disk, "files": files, "ratio": raw / disk,
            "tokens_min": min(tokens), "tokens_median": float(np.median(tokens)), "tokens_max": max(tokens)}


def build_read_store(path: Path, samples: list[Sample], n: int, row_block: int) -> dict[str, Any]:
    """Write ``n`` prompts, cycling through ``samples`` under texts ``"<text> #<i>"``."""
    run = run_description(str(samples[0].jacobian.dtype), row_block)
    texts = [f"{samples[i % len(samples)].text} #{i}" for i in range(n)]
    seconds = write_store(path, run, samples, texts)
    nbytes = sum(samples[i % len(samples)].nbytes for i in range(n))
    disk, files = tree_bytes(path / "prompts")
    index = {prompt_id(run, text): i % len(samples) for i, text in enumerate(texts)}
    return {"prompts": n, "distinct_jacobians": len(samples), "dtype": run["dtype"], "write_seconds": seconds,
            "write_mb_per_s": nbytes / seconds / MB, "uncompressed_bytes": nbytes, "disk_bytes": disk,
            "files": files, "index": index}


def sample_pairs(index: dict[str, int], samples: list[Sample], n: int, seed: int) -> list[list[Any]]:
    """``n`` seeded random (prompt id, token index) pairs."""
    rng = np.random.default_rng(seed)
    pids = sorted(index)
    pairs = []
    for _ in range(n):
        pid = pids[int(rng.integers(len(pids)))]
        pairs.append([pid, int(rng.integers(samples[index[pid]].jacobian.shape[1]))])
    return pairs


def read_worker(store_path: str, pairs_file: str, list_repeats: int = 5) -> dict[str, Any]:
    """Run in a fresh process: time listing and ``get(pid).operator(k)``; ``pairs[0]`` is the untimed warm-up."""
    pairs = json.loads(Path(pairs_file).read_text())
    started = time.perf_counter()
    n_ids = len(open_store(store_path).prompt_ids())
    first_list = time.perf_counter() - started
    lists = []
    for _ in range(list_repeats):
        started = time.perf_counter()
        open_store(store_path).prompt_ids()
        lists.append(time.perf_counter() - started)
    store = open_store(store_path)
    started = time.perf_counter()
    first = store.get(pairs[0][0]).operator(pairs[0][1])  # imports zarr, sets up codecs
    first_read = time.perf_counter() - started
    reads, shapes = [], set()
    for pid, k in pairs[1:]:
        started = time.perf_counter()
        op = store.get(pid).operator(k)
        reads.append(time.perf_counter() - started)
        shapes.add(op.shape)
    ms = 1e3 * np.asarray(reads)
    return {"listed_prompts": n_ids, "list_first_ms": 1e3 * first_list, "list_ms": [1e3 * t for t in lists],
            "list_median_ms": float(1e3 * np.median(lists)), "first_read_ms": 1e3 * first_read,
            "reads": len(reads), "read_median_ms": float(np.median(ms)), "read_p90_ms": float(np.percentile(ms, 90)),
            "read_min_ms": float(ms.min()), "read_max_ms": float(ms.max()),
            "operator_shapes": sorted({str(s) for s in shapes} | {str(first.shape)}),
            "worker_peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM; ``ru_maxrss`` would include the parent's at fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_worker(store: Path, pairs: list[list[Any]], work: Path) -> dict[str, Any]:
    """``read_worker`` in a fresh Python process (no torch imported, nothing cached in Python objects)."""
    pairs_file = work / "pairs.json"
    pairs_file.write_text(json.dumps(pairs))
    cmd = [sys.executable, "-m", __spec__.name, "--read-worker", str(store), str(pairs_file)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"Expected the read worker to succeed. Got exit code {done.returncode} (stderr above).")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_operators(store: Path, index: dict[str, int], samples: list[Sample], pairs: list[list[Any]]) -> bool:
    """Do the stored operators equal the Jacobians written (bit for bit)?"""
    opened = open_store(store)
    return all(np.array_equal(opened.get(pid).operator(k), samples[index[pid]].jacobian[:, k, :])
               for pid, k in pairs)


def read_latency(work: Path, samples: list[Sample], n_prompts: int, n_reads: int, row_block: int,
                 seed: int) -> dict[str, Any]:
    """Build a store of ``n_prompts`` prompts and time listing and operator reads in a fresh process."""
    per_prompt = max(s.nbytes for s in samples)
    free = shutil.disk_usage(work).free
    if free < 1.2 * per_prompt * n_prompts:
        raise SystemExit(f"Expected at least {1.2 * per_prompt * n_prompts / 1e9:.1f} GB free in {work} for the "
                         f"read store. Got {free / 1e9:.1f} GB; lower --read-prompts or use --dir.")
    path = work / "read.zarr"
    built = build_read_store(path, samples, n_prompts, row_block)
    index = built.pop("index")
    pairs = sample_pairs(index, samples, n_reads + 1, seed)
    result = {**built, **run_worker(path, pairs, work)}
    result["operators_equal_written"] = check_operators(path, index, samples, pairs[:5])
    shutil.rmtree(path)
    return result


def filesystem(path: Path) -> str:
    """``device fstype on mountpoint`` of the mount holding ``path`` (from /proc/mounts)."""
    real, best = os.path.realpath(path), ("?", "?", "")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "unknown"
    for line in lines:
        device, mount, fstype = line.split()[:3]
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[2]):
            best = (device, fstype, mount)
    return f"{best[0]} {best[1]} on {best[2]}"


def machine(work: Path) -> dict[str, Any]:
    """CPU, threads, disk and library versions."""
    import platform

    import numcodecs
    import torch
    import zarr

    usage = shutil.disk_usage(work)
    return {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "loadavg_at_start": list(os.getloadavg()),
            "dir": str(work), "filesystem": filesystem(work), "disk_free_gb": usage.free / 1e9,
            "python": platform.python_version(), "numpy": np.__version__, "zarr": zarr.__version__,
            "numcodecs": numcodecs.__version__, "torch": torch.__version__}


def print_throughput(tp: dict[str, Any]) -> None:
    """Table of write speeds for one dtype."""
    dtype, med = tp["dtype"], tp["median_mb_per_s"]
    print(f"\nWrite throughput, {dtype}: {tp['prompts']} prompts, {tp['uncompressed_bytes'] / MB:.1f} MB "
          f"uncompressed per round, {tp['rounds']} round(s), median MB/s (per round)")
    labels = {"store": "store writer API (zstd-3, shuffle, crc32c)", "numpy_fsync": "numpy.save + fsync",
              "numpy_nofsync": "numpy.save, no fsync (page cache)"}
    for key, label in labels.items():
        rounds = ", ".join(f"{v:.0f}" for v in tp["mb_per_s"][key])
        print(f"  {label:<44} {med[key]:8.1f} MB/s   ({rounds})")
    print(f"  ratio store / numpy.save+fsync               {tp['ratio_store_to_numpy_fsync']:8.2f}")
    print(f"  ratio store / numpy.save no fsync            {tp['ratio_store_to_numpy_nofsync']:8.2f}")


def print_report(res: dict[str, Any]) -> None:
    """The whole readable report."""
    m = res["machine"]
    print(f"\nMachine: {m['cpu_count']} CPUs ({m['cpus_usable']} usable), torch threads {m['torch_threads']}, "
          f"load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_at_start'])}")
    print(f"Disk: {m['dir']} ({m['filesystem']}, {m['disk_free_gb']:.0f} GB free)")
    print(f"Versions: python {m['python']}, numpy {m['numpy']}, zarr {m['zarr']}, numcodecs {m['numcodecs']}, "
          f"torch {m['torch']}")
    for dtype, seconds in res["engine_seconds"].items():
        print(f"Engine (not timed below): {dtype} Jacobians of {res['prompts']} prompts in {seconds:.1f} s")
    print(f"fsync: {FSYNC_NOTE}")
    for tp in res["throughput"]:
        print_throughput(tp)
    print("\nCompression (uncompressed bytes of all arrays / bytes of the files under <store>/prompts)")
    for c in res["compression"]:
        print(f"  {c['dtype']:<8} {c['prompts']:>5} prompts ({c['tokens_min']}-{c['tokens_max']} tokens, median "
              f"{c['tokens_median']:.0f}): {c['uncompressed_bytes'] / MB:9.1f} MB -> {c['disk_bytes'] / MB:9.1f} MB"
              f" in {c['files']} files   ratio {c['ratio']:.3f}")
    r = res["read"]
    print(f"\nRead latency: store of {r['listed_prompts']} prompts ({r['dtype']}; the same {r['distinct_jacobians']} "
          f"real Jacobians written under {r['prompts']} distinct prompt texts '<text> #<i>'), "
          f"{r['disk_bytes'] / 1e9:.2f} GB on disk")
    print(f"  building it: {r['write_seconds']:.1f} s, {r['write_mb_per_s']:.1f} MB/s sustained (uncompressed)")
    print("  timed in a fresh Python process, store opened anew; OS page cache warm (not dropped)")
    print(f"  open_store(path).prompt_ids()      first {r['list_first_ms']:8.2f} ms, median of "
          f"{len(r['list_ms'])} {r['list_median_ms']:8.2f} ms")
    print(f"  first get(pid).operator(k)         {r['first_read_ms']:8.2f} ms (imports zarr; not counted)")
    print(f"  get(pid).operator(k), {r['reads']} random    median {r['read_median_ms']:8.2f} ms, "
          f"p90 {r['read_p90_ms']:8.2f} ms (min {r['read_min_ms']:.2f}, max {r['read_max_ms']:.2f}); "
          f"shape {', '.join(r['operator_shapes'])}")
    print(f"  operators equal the Jacobians written (5 checked): {r['operators_equal_written']}")
    print(f"\nPeak RSS: this process {res['peak_rss_mb']:.0f} MB, read worker {r['worker_peak_rss_mb']:.0f} MB; "
          f"total {res['seconds']:.0f} s")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=40, help="prompts per dtype for throughput and compression")
    p.add_argument("--read-prompts", type=int, default=1000, help="prompts in the read-latency store")
    p.add_argument("--read-dtype", choices=("float32", "float64"), default="float32",
                   help="dtype of the read-latency store (float64 doubles its size and build time)")
    p.add_argument("--reads", type=int, default=50, help="random (prompt, token) operator reads to time")
    p.add_argument("--rounds", type=int, default=2, help="alternating write rounds (median reported)")
    p.add_argument("--row-block", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=None, help="parent of the temporary folder (default: system temp)")
    p.add_argument("--prompt-file", type=Path, default=HERE / "data" / "heldout_prompts.txt")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON results (default benchmarks/results/store_bench.json; none with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
    p.add_argument("--read-worker", nargs=2, metavar=("STORE", "PAIRS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.prompts, args.read_prompts, args.reads, args.rounds = 3, 20, 10, 1
    if args.out is None and not args.quick:
        args.out = HERE / "results" / "store_bench.json"
    return args


def run_all(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement, in order; temporary stores are deleted as soon as they are measured."""
    res: dict[str, Any] = {"machine": machine(work), "prompts": args.prompts, "throughput": [], "compression": [],
                           "engine_seconds": {}}
    texts = read_prompts(args.prompt_file, args.prompts)
    samples = {}
    for dtype in ("float64", "float32"):
        print(f"[store_bench] computing {len(texts)} {dtype} Jacobians (engine, not timed) ...", flush=True)
        samples[dtype], res["engine_seconds"][dtype] = compute_samples(texts, dtype, args.row_block)
    for dtype in ("float64", "float32"):
        print(f"[store_bench] write throughput and compression, {dtype} ...", flush=True)
        folder = work / dtype
        folder.mkdir()
        tp = {"dtype": dtype, **throughput(folder, samples[dtype], args.rounds, args.row_block)}
        res["throughput"].append(tp)
        res["compression"].append(compression(Path(tp.pop("store_path")), samples[dtype]))
        shutil.rmtree(folder)
    print(f"[store_bench] read latency: writing {args.read_prompts} {args.read_dtype} prompts ...", flush=True)
    res["read"] = read_latency(work, samples[args.read_dtype], args.read_prompts, args.reads, args.row_block,
                               args.seed)
    return res


def main() -> None:
    args = parse_args()
    if args.read_worker:
        print(json.dumps(read_worker(*args.read_worker)))
        return
    started = time.perf_counter()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="detjac-store-bench-", dir=args.dir))
    try:
        res = run_all(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    res["seconds"] = time.perf_counter() - started
    res["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "read_worker"}
    print_report(res)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
