"""Tables and figures of the lens: summaries with 95 % intervals (Wilson for agreement rates, a normal interval
for the mean error) of :func:`~detjac.analysis.lens.jacobian_lens.score_lens`'s rows, and PNG figures. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

Z95 = 1.96


def wilson(hits: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95 % Wilson score interval of a binomial fraction ``hits / n`` (nan, nan for n = 0)."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))  # at 0 or n hits rounding would step outside


def summarize_lens(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per (layer, method): prompts ``n``, ``top1`` and ``top10`` agreement with their Wilson intervals, the mean
    relative error with a normal 95 % interval, its median and maximum."""
    groups: dict[tuple[int, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((int(r["layer"]), str(r["method"])), []).append(r)
    out = []
    for (layer, method), group in sorted(groups.items()):
        n = len(group)
        ranks = np.array([g["rank"] for g in group])
        errors = np.array([g["error"] for g in group], dtype=np.float64)
        top1, top10 = int((ranks == 1).sum()), int((ranks <= 10).sum())
        half = Z95 * errors.std(ddof=1) / math.sqrt(n) if n > 1 else float("nan")
        out.append({"layer": layer, "method": method, "n": n, "top1": top1 / n, "top1_low": wilson(top1, n)[0],
                    "top1_high": wilson(top1, n)[1], "top10": top10 / n, "top10_low": wilson(top10, n)[0],
                    "top10_high": wilson(top10, n)[1], "error_mean": float(errors.mean()),
                    "error_low": float(errors.mean() - half), "error_high": float(errors.mean() + half),
                    "error_median": float(np.median(errors)), "error_max": float(errors.max())})
    return out


def lens_markdown(summary: Sequence[Mapping[str, Any]]) -> str:
    """The summary as a Markdown table (what docs/lens.md shows)."""
    lines = ["| layer | method | n | top-1 agreement (95 % CI) | top-10 agreement (95 % CI) | relative error, mean "
             "(95 % CI) | median |", "|---|---|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['layer']} | {r['method']} | {r['n']} | {100 * r['top1']:.1f} % "
                     f"({100 * r['top1_low']:.1f}–{100 * r['top1_high']:.1f}) | {100 * r['top10']:.1f} % "
                     f"({100 * r['top10_low']:.1f}–{100 * r['top10_high']:.1f}) | {r['error_mean']:.3g} "
                     f"({r['error_low']:.3g}–{r['error_high']:.3g}) | {r['error_median']:.3g} |")
    return "\n".join(lines)


def plot_agreement(summary: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Top-1 and top-10 agreement against depth, one line per method with its 95 % band; relative error beside."""
    from ..plots import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    methods = list(dict.fromkeys(r["method"] for r in summary))
    for i, method in enumerate(methods):
        rows = [r for r in summary if r["method"] == method]
        layers = [r["layer"] for r in rows]
        for ax, key in zip(axes[:2], ("top1", "top10"), strict=True):
            ax.plot(layers, [100 * r[key] for r in rows], "o-", color=f"C{i}", label=method)
            ax.fill_between(layers, [100 * r[f"{key}_low"] for r in rows], [100 * r[f"{key}_high"] for r in rows],
                            color=f"C{i}", alpha=0.2)
        axes[2].plot(layers, [max(r["error_mean"], 1e-17) for r in rows], "o-", color=f"C{i}", label=method)
    for ax, label in zip(axes, ("top-1 agreement (%)", "top-10 agreement (%)", "relative error of y (mean)"),
                         strict=True):
        ax.set_xlabel("layer")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def plot_positions(ranks: Mapping[str, np.ndarray], layers: Sequence[int], tokens: Sequence[str], path: str | Path,
                   title: str = "") -> Path:
    """Layer x position heatmaps, one per method: the rank of the model's own prediction at each position."""
    from ..plots import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(ranks), figsize=(4 + 0.5 * len(tokens) * len(ranks), 3 + 0.3 * len(layers)),
                             squeeze=False)
    for ax, (method, grid) in zip(axes[0], ranks.items(), strict=True):
        image = ax.imshow(np.log10(grid), aspect="auto", cmap="viridis_r", vmin=0, origin="lower")
        for (i, j), value in np.ndenumerate(grid):
            ax.text(j, i, str(int(value)) if value < 1000 else "", ha="center", va="center", fontsize=7,
                    color="white" if value > 10 else "black")
        ax.set_title(method)
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
        ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=7)
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax, label="log10 rank of the model's prediction")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)
