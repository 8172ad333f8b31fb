"""``detjac analyze layers`` on the default model's 2-prompt layerwise store: in-memory path against the dask path.

Writes the store once (``detjac run default ... --layers all --components layer,attn,mlp``: 12 targets per
prompt), then times the whole layer report on fresh copies of it, with the Jacobians read once into numpy
(the default for Jacobians up to ``analysis.layers.DENSE_BYTES``) and with every Jacobian streamed through dask
(``DENSE_BYTES = 0``, the path larger Jacobians take, and the only one before). Reports both times (wall and
CPU: the machine may be shared), their ratios and the largest difference between the two reports' numbers.

    .venv/bin/python -m benchmarks.layer_report        # ~1.5 minutes on 2 shared cores
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = ["The bridge out of Marin is the", "Whale, n. (Zool.) Any aquatic mammal of the order Cetacea."]


REPORT = """
import json, sys, time
from detjac.analysis import layers, layerwise_report
from detjac.store import open_store

layers.DENSE_BYTES = int(sys.argv[3])
start, cpu = time.perf_counter(), time.process_time()
s = open_store(sys.argv[1])
rows = layerwise_report(s, s.prompt_ids(), sys.argv[2]).rows
print(json.dumps({"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu, "rows": rows}))
"""


def report_seconds(store: Path, work: Path, name: str, dense_bytes: int) -> tuple[float, float, list[dict]]:
    """The layer report of a fresh copy of ``store`` in a fresh process (no torch loaded, as in the CLI)."""
    copy = work / name
    shutil.copytree(store, copy)
    out = subprocess.run([sys.executable, "-c", REPORT, str(copy), str(work / f"{name}-out"), str(dense_bytes)],
                         check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["seconds"], result["cpu"], result["rows"]


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    from click.testing import CliRunner

    from detjac.cli.main import main as cli

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "p.txt").write_text("\n".join(PROMPTS) + "\n")
        result = CliRunner().invoke(cli, ["run", "default", str(work / "p.txt"), "--out", str(work / "s.zarr"),
                                          "--layers", "all", "--components", "layer,attn,mlp"])
        assert result.exit_code == 0, result.output
        dense, dense_cpu, a = report_seconds(work / "s.zarr", work, "dense", 256 * 2**20)
        streamed, streamed_cpu, b = report_seconds(work / "s.zarr", work, "dask", 0)
        diff = max(abs(x[c] - y[c]) / max(1.0, abs(y[c])) for x, y in zip(a, b, strict=True)
                   for c in ("sigma_1", "stable_rank", "participation_ratio", "n90", "n99", "u1_rank", "lens_rank"))
        print(f"layer report, {len(a)} targets: in memory {dense:.1f} s ({dense_cpu:.1f} s CPU), through dask "
              f"{streamed:.1f} s ({streamed_cpu:.1f} s CPU); ratio {streamed / dense:.1f}x wall, "
              f"{streamed_cpu / dense_cpu:.1f}x CPU; largest relative difference of the table's numbers {diff:.1e}")


if __name__ == "__main__":
    main()
