"""A picture of an attribution graph JSON (written by ``detjac graph``): nodes by layer and position, the strongest
links by weight and sign. For the docs' worked example.

    .venv/bin/python -m benchmarks.graph_picture france.json docs/graph-france.png --links 250
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from detjac.graph_nodes import LOGIT, NEURON, TOKEN


def draw(data: dict, out: Path, links: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = {n["node_id"]: n for n in data["nodes"]}
    layers = [int(n["layer"]) for n in nodes.values() if n["feature_type"] == NEURON.name]
    top = max([*layers, 0]) + 2
    tokens = data["metadata"]["prompt_tokens"]

    def place(n: dict) -> tuple[float, float]:
        if n["feature_type"] == "embedding":
            y = -1.0
        elif n["feature_type"] == "logit":
            y = float(top)
        else:
            y = float(n["layer"])
        same = [m for m in nodes.values() if m["ctx_idx"] == n["ctx_idx"] and m["layer"] == n["layer"]]
        k = same.index(n)
        return n["ctx_idx"] + 0.8 * (k + 0.5) / len(same) - 0.4, y

    at = {i: place(n) for i, n in nodes.items()}
    strongest = sorted(data["links"], key=lambda e: -abs(e["weight"]))[:links]
    biggest = max((abs(e["weight"]) for e in strongest), default=1.0)
    fig, ax = plt.subplots(figsize=(11, 7))
    for e in reversed(strongest):
        (x0, y0), (x1, y1) = at[e["source"]], at[e["target"]]
        share = abs(e["weight"]) / biggest
        ax.plot([x0, x1], [y0, y1], color="#2471a3" if e["weight"] > 0 else "#c0392b", alpha=0.15 + 0.6 * share,
                linewidth=0.3 + 2.5 * share, zorder=1)
    kinds = {TOKEN.name: ("#555555", "s"), NEURON.name: ("#f39c12", "o"), LOGIT.name: ("#27ae60", "D")}
    for kind, (colour, marker) in kinds.items():
        pts = [at[i] for i, n in nodes.items() if n["feature_type"] == kind]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=18 if kind == NEURON.name else 60, color=colour, marker=marker,
                       zorder=2, label=kind)
    for n in nodes.values():
        if n["feature_type"] == "logit" and n.get("is_target_logit"):
            x, y = at[n["node_id"]]
            ax.annotate(n["clerp"], (x, y), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=9)
    ax.set_xticks(range(len(tokens)), [repr(t) for t in tokens], rotation=30, ha="right")
    ax.set_yticks([-1, *range(top - 1), top], ["tokens", *[str(i) for i in range(top - 1)], "logits"])
    ax.set_ylabel("layer")
    info = data["metadata"].get("info", {})
    ax.set_title(f"{data['metadata']['prompt']!r}: {len(nodes)} nodes, the {len(strongest)} strongest of "
                 f"{len(data['links'])} links (blue +, red -); completeness {info.get('completeness', 0):.0e}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("graph", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--links", type=int, default=250)
    args = parser.parse_args()
    draw(json.loads(args.graph.read_text()), args.out, args.links)


if __name__ == "__main__":
    main()
