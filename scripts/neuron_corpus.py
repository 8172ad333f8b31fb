"""The corpus of the SmolLM2 neuron index (docs/performance.md, "Neuron indexes"): 2,061 prompts available offline.

Every Factbook prompt (``benchmarks/data/factbook_prompts.jsonl``, 561), every held-out GCIDE prefix
(``benchmarks/data/heldout_prompts.txt``, 300), and 1,200 prefixes of GCIDE training entries: the 1,000 of
``benchmarks/data/lens_fit_prompts.txt`` and the next 200 by the same rule
(``python -m scripts.lens_prompts --count 1200``, whose first 1,000 lines are that file; it reads the pinned Debian
package, e.g. from apt's cache). Writes
``benchmarks/data/neuron_corpus.txt``, one prompt a line.

    .venv/bin/python -m scripts.lens_prompts --count 1200 --cache /var/cache/apt/archives --out /tmp/lens1200.txt
    .venv/bin/python -m scripts.neuron_corpus /tmp/lens1200.txt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lens_prompts", type=Path, help="the output of python -m scripts.lens_prompts --count 1200")
    lens = parser.parse_args().lens_prompts.read_text(encoding="utf-8").splitlines()
    shipped = (DATA / "lens_fit_prompts.txt").read_text(encoding="utf-8").splitlines()
    if lens[:len(shipped)] != shipped or len(lens) < 1200:
        raise SystemExit("Expected python -m scripts.lens_prompts --count 1200 output, whose first 1,000 lines are "
                         "benchmarks/data/lens_fit_prompts.txt.")
    factbook = [json.loads(line)["text"] for line in (DATA / "factbook_prompts.jsonl").read_text().splitlines()]
    heldout = (DATA / "heldout_prompts.txt").read_text(encoding="utf-8").splitlines()
    lines = [t.strip() for t in factbook + heldout + lens[:1200] if t.strip()]
    (DATA / "neuron_corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} prompts to {DATA / 'neuron_corpus.txt'}")


if __name__ == "__main__":
    main()
