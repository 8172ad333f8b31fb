"""Cost of fitting the lens from a store: time and peak memory against the number of prompts.

Copies a store with ``to_output`` targets (default: one written by
``detjac run default benchmarks/data/lens_fit_prompts.txt --out fit.zarr --layers all --components to_output``),
keeps its first N prompts for each N, and times ``detjac lens fit`` on the copy in a fresh process (peak
resident memory from ``getrusage`` of the child). Ratios, not assertions.

    .venv/bin/python benchmarks/lens_fit.py fit.zarr --counts 12,24,48
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def fit_copy(store: Path, count: int, workdir: Path, chunk: int) -> dict:
    copy = workdir / f"n{count}.zarr"
    shutil.copytree(store, copy, ignore=shutil.ignore_patterns("lens"))
    for folder in sorted(p for p in (copy / "prompts").iterdir() if p.is_dir())[count:]:
        shutil.rmtree(folder)
    code = ("import sys; from detjac.analysis.lens_fit import fit; from detjac.store import open_store; "
            "fit(open_store(sys.argv[1]), chunk=int(sys.argv[2]))")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(copy), str(chunk)], check=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # MiB; the largest child so far
    shutil.rmtree(copy)
    return {"prompts": count, "seconds": seconds, "peak_rss_mib_so_far": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("--counts", default="12,24,48")
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "lens_fit.json")
    args = parser.parse_args()
    counts = sorted(int(c) for c in args.counts.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        rows = [fit_copy(args.store, n, Path(tmp), args.chunk) for n in counts]
    for r in rows:
        r["seconds_per_prompt"] = r["seconds"] / r["prompts"]
        print(f"{r['prompts']:>6} prompts: {r['seconds']:.1f} s ({r['seconds_per_prompt']:.3f} s/prompt), "
              f"peak RSS so far {r['peak_rss_mib_so_far']:.0f} MiB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
