"""What opening a prompt costs: ``store.get(pid)`` on a 100-prompt synthetic store, per open.

A synthetic store (``detjac.store.testing``: d_model 256, 8 tokens, two layerwise targets per prompt, so
each prompt folder holds 14 arrays: 14 sealed ``zarr.json`` files besides its chunks) is written once into a
temporary folder; every prompt is then opened ``--rounds`` times in this process and the median time per
open is printed. Opening checks the prompt's attributes, its files' names and sizes, and (since issue 53) the
SHA-256 of every ``zarr.json`` the reads depend on.

    .venv/bin/python -m benchmarks.prompt_open              # ~30 s on 2 cores
    .venv/bin/python -m benchmarks.prompt_open --prompts 20 --rounds 2

Warm page cache; the figure depends on whatever else runs on the machine. Never used in tests.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--d-model", type=int, default=256)
    args = parser.parse_args()
    from detjac.store import open_store
    from detjac.store.testing import make_store

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.zarr"
        make_store(path, prompts=args.prompts, d_model=args.d_model, n_tokens=8, vocab=300, n_layers=2,
                   targets=("layer.0", "mlp.1"), row_block=64)
        store = open_store(path)
        ids = store.prompt_ids()
        store.get(ids[0])  # imports zarr, sets up codecs: not counted
        times = []
        for _ in range(args.rounds):
            for pid in ids:
                start = time.perf_counter()
                store.get(pid)
                times.append(time.perf_counter() - start)
        files = sum(1 for _ in (path / "prompts" / ids[0]).rglob("*") if _.is_file())
        print(f"{len(ids)} prompts, {files} files per prompt, {len(times)} opens: "
              f"median {1e3 * statistics.median(times):.2f} ms, mean {1e3 * statistics.fmean(times):.2f} ms per open")


if __name__ == "__main__":
    main()
