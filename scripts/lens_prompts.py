"""Prompts to fit a lens of the default model on: prefixes of GCIDE *training* entries.

The held-out prompts (``benchmarks/data/heldout_prompts.txt``) are prefixes of the 2 % of
entries the model never saw; a lens evaluated on them must be fitted elsewhere, so this
writes prefixes of training entries, chosen by the same rule (6-16 words, length and order
from a SHA-256 of the entry; none chosen by how the model does on it), to
``benchmarks/data/lens_fit_prompts.txt``. The corpus is the pinned Debian package the model
was trained on (``scripts/gcide.py``; kept in ``~/.cache/detjac/corpus``).

    .venv/bin/python -m scripts.lens_prompts --count 1000
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import gcide

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000, help="prompts to write")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "detjac" / "corpus")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data" / "lens_fit_prompts.txt")
    args = parser.parse_args()
    train, _ = gcide.split_entries(gcide.entries(gcide.fetch_deb(args.cache)))
    prompts = gcide.entry_prefixes(train, args.count)  # the rule of the held-out prompts
    args.out.write_text("\n".join(prompts) + "\n")
    print(f"wrote {len(prompts)} prefixes of training entries to {args.out}")


if __name__ == "__main__":
    main()
