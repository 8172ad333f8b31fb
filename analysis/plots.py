"""Figures of detached-Jacobian spectra (matplotlib, Agg backend; numpy in, PNG/SVG out)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class SpectrumPanel:
    """One subplot: a title, the combined operator's spectrum and each token's."""

    title: str
    combined: Sequence[float]
    per_token: Mapping[str, Sequence[float]] = field(default_factory=dict)


def plot_spectra(panels: Sequence[SpectrumPanel], path: str | Path, suptitle: str | None = None) -> Path:
    """Singular values (log scale) against their index, one panel per prompt.

    Per-token spectra are thin lines coloured from first (light) to last token (dark); the
    combined operator ``[J_1 ... J_n]`` is the thick black line. The file type follows the
    suffix of ``path`` (``.png``, ``.svg``, ``.pdf``). Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("Expected at least one spectrum panel. Got none.")
    path = Path(path)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.4 * len(panels), 6.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        colours = plt.cm.viridis(np.linspace(0.85, 0.1, max(1, len(panel.per_token))))
        for colour, (label, values) in zip(colours, panel.per_token.items(), strict=False):
            ax.semilogy(np.arange(1, len(values) + 1), np.asarray(values), color=colour, lw=0.9, label=label)
        ax.semilogy(np.arange(1, len(panel.combined) + 1), np.asarray(panel.combined), color="black", lw=2.2,
                    label="combined [J_1 ... J_n]")
        ax.set_title(panel.title, fontsize=9)
        ax.set(xlabel="singular value index", ylabel="singular value")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    from .glyphs import make_drawable

    make_drawable(fig)  # token texts: never a missing-glyph warning
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    from .glyphs import make_drawable

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    make_drawable(fig)  # token texts: fallback fonts, else escapes; never a missing-glyph warning
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return path


def plot_token_heatmap(heat: Mapping[str, Any], path: str | Path, token_text: str, title: str = "") -> Path:
    """Layer x input-token ranks of a token (from :func:`detjac.analysis.layers.token_heatmap`), two panels:
    in the decoded leading singular vector of each ``J_k``, and in the decoded contribution ``J_k x_k``.

    Colour is log10 of the rank (dark: rank 1, the top token), so emergence reads top to bottom.
    """
    from matplotlib.colors import LogNorm

    plt = pyplot()
    layers, tokens = list(heat["layers"]), list(heat["tokens"])
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.42 * len(tokens) + 2.5), 2 * (0.32 * len(layers) + 1.6)),
                             squeeze=False)
    vmax = max(int(heat["u1_rank"].max()), int(heat["contribution_rank"].max()), 2)
    for ax, key, label in ((axes[0][0], "u1_rank", "u_1 of J_k"), (axes[1][0], "contribution_rank", "J_k x_k")):
        image = ax.imshow(heat[key], aspect="auto", cmap="magma", norm=LogNorm(vmin=1, vmax=vmax),
                          interpolation="nearest")
        for (i, k), rank in np.ndenumerate(heat[key]):
            if rank <= 10:
                ax.text(k, i, str(rank), ha="center", va="center", fontsize=6, color="white")
        ax.set_xticks(range(len(tokens)), [t.replace("\n", "\\n") for t in tokens], rotation=70, fontsize=7)
        ax.set_yticks(range(len(layers)), [f"{heat['component']}.{layer}" for layer in layers], fontsize=7)
        ax.set_title(f"rank of {token_text} in decoded {label}", fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.9, pad=0.01, label="rank (1 = top)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_layer_dims(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Dimensionality and leading singular value of each layerwise target across depth (median over prompts).

    Rows are :func:`detjac.analysis.layers.layer_table` rows; one line per component, dashed
    for ``*_local`` targets (a layer alone w.r.t. its own input).
    """
    plt = pyplot()
    series: dict[str, dict[int, list[Mapping[str, Any]]]] = {}
    for r in rows:
        series.setdefault(r["component"] + ("_local" if r["local"] else ""), {}).setdefault(r["layer"], []).append(r)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.0))
    for name, by_layer in sorted(series.items()):
        layers = sorted(by_layer)
        style = "--" if name.endswith("_local") else "-"
        for ax, key in zip(axes, ("stable_rank", "n90", "sigma_1"), strict=True):
            ax.plot(layers, [np.median([r[key] for r in by_layer[layer]]) for layer in layers], style, marker="o",
                    ms=3, label=name)
    for ax, label in zip(axes, ("stable rank of [J_1 ... J_n]", "singular values for 90 % of the energy",
                                "sigma_1"), strict=True):
        ax.set(xlabel="layer", ylabel=label)
        ax.set_xticks(sorted({r["layer"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(title or "Layerwise detached Jacobians across depth (median over prompts)", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_emergence(rows: Sequence[Mapping[str, Any]], path: str | Path, top: int) -> Path:
    """Share of prompts whose predicted token is in the top decoded tokens, per layer and component:
    of ``u_1`` (solid) and of the output vector itself, the logit lens (dotted)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    by: dict[str, dict[int, list[Mapping[str, Any]]]] = {}
    for r in rows:
        if not r["local"]:
            by.setdefault(r["component"], {}).setdefault(r["layer"], []).append(r)
    for i, (name, by_layer) in enumerate(sorted(by.items())):
        colour = f"C{i % 10}"
        layers = sorted(by_layer)
        ax.plot(layers, [np.mean([r["u1_hit"] for r in by_layer[layer]]) for layer in layers], "-o", ms=3,
                color=colour, label=f"{name}: u_1")
        ax.plot(layers, [np.mean([r["lens_rank"] <= top for r in by_layer[layer]]) for layer in layers], ":",
                color=colour, label=f"{name}: output (logit lens)")
    ax.set_xticks(sorted({r["layer"] for r in rows}))
    ax.set(xlabel="layer", ylabel=f"share of prompts, prediction in top {top}", ylim=(-0.03, 1.03),
           title="Where the predicted token emerges")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_decoded(sections: Sequence[tuple[str, Sequence[Sequence[str]]]], path: str | Path) -> Path:
    """Decoded singular vectors as table figures, one per section: (title, rows of [#, sigma, left, right]).

    Every column is as wide as its longest cell (measured when drawn), and the figure as wide as the widest table,
    so no cell's text runs into the next column or off the page.
    """
    from .glyphs import make_drawable

    plt = pyplot()
    if not sections:
        raise ValueError("Expected at least one decoded spectrum. Got none.")
    heights = [0.3 * len(rows) + 0.7 for _, rows in sections]
    fig, axes = plt.subplots(len(sections), 1, figsize=(13, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    fig.subplots_adjust(left=0.01, right=0.99)
    tables = []
    for ax, (title, rows) in zip(axes[:, 0], sections, strict=True):
        ax.axis("off")
        table = ax.table(cellText=[list(r) for r in rows], loc="upper left", cellLoc="left",
                         colLabels=["#", "sigma", "left vector -> unembedding", "right vector -> embedding [token]"])
        table.auto_set_font_size(False)
        table.set_fontsize(7)
        for cell in table.get_celld().values():
            cell.PAD = 0.02  # of the cell's width: the default 0.1 indents a wide column's text by a tenth of it
        table.auto_set_column_width(range(4))  # widths from the text, recomputed at every draw
        ax.set_title(title, fontsize=8, loc="left")
        tables.append(table)
    make_drawable(fig)  # before measuring: an escape is wider than the glyph it stands for
    fig.canvas.draw()  # measure: the tables' widths in pixels do not depend on the figure's
    widest = max(t.get_window_extent().width for t in tables) / fig.dpi
    # a table starts 0.01 (the margin) + 0.98 * 0.02 (matplotlib's AXESPAD) of the width in and ends 0.01 short
    fig.set_figwidth(max(4.0, widest / (0.99 - 0.01 - 0.98 * 0.02) + 0.05))
    return save_figure(fig, path)
