"""Cost of the lens: fitting it from a store (time and peak memory against the number of prompts), and the
``detjac run --lens`` route against the stored route (run with ``to_output`` targets, then fit).

**Fit.** For each N of ``--counts``, a copy of the store (files hard-linked: no extra disk) keeps its first N
prompts (by id, i.e. a hash-random subset), and ``fit`` runs on it in a fresh process, which reports its own
wall time for the fit (imports excluded) and its peak resident memory (``getrusage`` of that child alone,
``os.wait4``). The store, e.g. 1,000 prompts of the default model (``--write-prefixes`` writes the prompts
used: the first 3 words of each line of ``benchmarks/data/lens_fit_prompts.txt``, longer where needed to keep
them distinct, ~9.7 tokens each)::

    .venv/bin/python -m benchmarks.lens_fit --write-prefixes prefix3.txt
    detjac run default prefix3.txt --out fit1000.zarr --layers all --components to_output --dtype float32
    .venv/bin/python -m benchmarks.lens_fit fit fit1000.zarr --counts 100,250,500,1000

**Routes.** ``routes PROMPTS --limit N``: the first N prompts through ``detjac run --lens`` and through
``detjac run --layers all --components to_output`` + ``detjac lens fit`` (each a fresh process, the same
``--dtype``), timed, with peak memory, the stores' sizes on disk, and the largest difference between the
two lenses. Ratios, not assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIT_CODE = """
import json, resource, sys, time
from detjac.analysis import fit_lens
from detjac.store import open_store

start = time.perf_counter()
fit_lens(open_store(sys.argv[1]), chunk=int(sys.argv[2]))
print(json.dumps({"fit_seconds": time.perf_counter() - start}))
"""


def child(command: list[str]) -> dict:
    """Run ``command``; its wall time, its own peak RSS (MiB) and its stdout's last line as JSON when it is."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command)} exited with {proc.returncode}")
    row = {"seconds": time.perf_counter() - start, "peak_rss_mib": usage.ru_maxrss / 1024}
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if last.startswith("{"):
        row.update(json.loads(last))
    return row


def fit_copy(store: Path, count: int, workdir: Path, chunk: int) -> dict:
    copy = workdir / f"n{count}.zarr"
    shutil.copytree(store, copy, ignore=shutil.ignore_patterns("lens"), copy_function=os.link)
    for folder in sorted(p for p in (copy / "prompts").iterdir() if p.is_dir())[count:]:
        shutil.rmtree(folder)
    row = {"prompts": count, **child([sys.executable, "-c", FIT_CODE, str(copy), str(chunk)])}
    shutil.rmtree(copy)
    row["fit_seconds_per_prompt"] = row["fit_seconds"] / count
    print(f"{count:>6} prompts: fit {row['fit_seconds']:.1f} s ({row['fit_seconds_per_prompt']:.3f} s/prompt), "
          f"process {row['seconds']:.1f} s, peak RSS {row['peak_rss_mib']:.0f} MiB", flush=True)
    return row


def size_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def routes(prompts: Path, limit: int, dtype: str, workdir: Path) -> dict:
    import numpy as np

    from detjac.analysis.lens import load_lens

    lines = [line for line in prompts.read_text().splitlines() if line.strip()][:limit]
    subset = workdir / "prompts.txt"
    subset.write_text("\n".join(lines) + "\n")
    cli = [sys.executable, "-m", "detjac.cli.main"]
    stored, lens = workdir / "stored.zarr", workdir / "lens.zarr"
    out = {"prompts": len(lines), "dtype": dtype}
    out["stored_run"] = child([*cli, "run", "default", str(subset), "--out", str(stored), "--layers", "all",
                               "--components", "to_output", "--dtype", dtype])
    out["stored_fit"] = child([*cli, "lens", "fit", str(stored)])
    out["lens_run"] = child([*cli, "run", "default", str(subset), "--out", str(lens), "--lens", "--dtype", dtype])
    out["stored_mib"], out["lens_mib"] = size_mib(stored), size_mib(lens)
    a, b = load_lens(stored), load_lens(lens)
    out["max_relative_difference"] = float(np.abs(a.mean - b.mean).max() / np.abs(a.mean).max())
    both = out["stored_run"]["seconds"] + out["stored_fit"]["seconds"]
    out["seconds_per_prompt"] = {"stored_run_plus_fit": both / len(lines),
                                 "lens_run": out["lens_run"]["seconds"] / len(lines)}
    out["ratio_stored_over_lens"] = both / out["lens_run"]["seconds"]
    print(json.dumps(out, indent=2), flush=True)
    return out


def write_prefixes(out: Path) -> None:
    """The first 3 words of each fit prompt, one more word at a time until it differs from the earlier ones."""
    seen: set[str] = set()
    lines = []
    for line in (HERE / "data" / "lens_fit_prompts.txt").read_text().splitlines():
        words, n = line.split(), 3
        while " ".join(words[:n]) in seen and n < len(words):
            n += 1
        lines.append(" ".join(words[:n]))
        seen.add(lines[-1])
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} prompts to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=("fit", "routes"))
    parser.add_argument("source", nargs="?", type=Path, help="fit: a store with to_output targets; routes: prompts")
    parser.add_argument("--counts", default="100,250,500,1000")
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--write-prefixes", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "lens_fit.json")
    args = parser.parse_args()
    if args.write_prefixes is not None:
        write_prefixes(args.write_prefixes)
        return
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results = results if isinstance(results, dict) else {"earlier_fit": results}
    with tempfile.TemporaryDirectory(dir=args.source.parent if args.what == "fit" else None) as tmp:
        if args.what == "fit":
            counts = sorted(int(c) for c in args.counts.split(","))
            results["fit"] = {"store": str(args.source), "chunk": args.chunk,
                              "rows": [fit_copy(args.source, n, Path(tmp), args.chunk) for n in counts]}
        else:
            results["routes"] = routes(args.source, args.limit, args.dtype, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
