"""Figures of :mod:`detjac.analysis.views` (matplotlib, Agg backend; numpy in, PNG out)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .plots import pyplot, save_figure


def plot_columns(rows: Sequence[Mapping[str, Any]], path: str | Path, text: Callable[[int], str],
                 token_labels: Sequence[str], title: str = "") -> Path:
    """The largest-norm columns of each ``J_k`` (rows of :func:`~detjac.analysis.views.largest_columns`): one panel
    per token, one bar per column (its norm), labelled with the input dimension and its decoded tokens."""
    plt = pyplot()
    by: dict[int, list[Mapping[str, Any]]] = {}
    for r in rows:
        by.setdefault(int(r["token"]), []).append(r)
    count = max(len(v) for v in by.values())
    fig, axes = plt.subplots(len(by), 1, figsize=(10, (0.28 * count + 0.8) * len(by)), squeeze=False)
    for ax, (k, cols) in zip(axes[:, 0], sorted(by.items()), strict=True):
        y = np.arange(len(cols))[::-1]
        ax.barh(y, [c["norm"] for c in cols], color="C0")
        ax.set_yticks(y, [f"col {c['column']}: " + " ".join(text(t) for t in c["decoded"][:5]) for c in cols],
                      fontsize=7)
        ax.set_title(f"token {k} {token_labels[k] if k < len(token_labels) else ''}: largest columns of J_{k}",
                     fontsize=8, loc="left")
        ax.set_xlabel("column norm", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_jacobian_image(image: Mapping[str, Any], path: str | Path, title: str = "", svs: int = 16) -> Path:
    """``J_k`` as an image (diverging colours, symmetric about 0 at its 99.5th percentile of |entries|), with its
    leading singular values in an inset."""
    plt = pyplot()
    J = np.asarray(image["matrix"])
    vmax = float(np.quantile(np.abs(J), 0.995)) or 1.0
    fig, ax = plt.subplots(figsize=(9, 7.5))
    shown = ax.imshow(J, cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest")
    fig.colorbar(shown, ax=ax, shrink=0.8)
    ax.set(xlabel="input dimension (column)", ylabel="output dimension (row)")
    inset = ax.inset_axes((0.62, 0.66, 0.34, 0.3))
    s = np.asarray(image["singular_values"])[:svs]
    inset.plot(np.arange(1, len(s) + 1), s, "-o", ms=3)
    inset.set_facecolor("white")
    inset.set_title("singular values", fontsize=7)
    inset.tick_params(labelsize=6)
    inset.grid(alpha=0.3)
    ax.set_title(title or f"{image['target']}: J_{image['token']}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_path(path_data: Mapping[str, Any], path: str | Path, text: Callable[[int], str], title: str = "") -> Path:
    """Each layer's ``u_1`` and ``u_2`` projected on the last layer's (the two axes), a line through depth; each
    point labelled with its layer and the first decoded tokens of its ``u_1``."""
    plt = pyplot()
    proj, layers, decoded = np.asarray(path_data["projections"]), path_data["layers"], path_data["decoded"]
    fig, ax = plt.subplots(figsize=(8, 7))
    colours = plt.cm.plasma(np.linspace(0.05, 0.85, len(layers)))
    y = proj[:, 1] if proj.shape[1] > 1 else np.zeros(len(layers))
    for i in range(len(layers) - 1):
        ax.plot(proj[i:i + 2, 0], y[i:i + 2], color=colours[i], lw=1.5)
    ax.scatter(proj[:, 0], y, c=colours, zorder=3)
    for i, layer in enumerate(layers):
        ax.annotate(f"{layer}: " + " ".join(text(t) for t in decoded[i][0][:3]), (proj[i, 0], y[i]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    last = decoded[-1]
    ax.set_xlabel("u_1 . u_1(last layer): " + " ".join(text(t) for t in last[0][:4]), fontsize=8)
    ax.set_ylabel("u_2 . u_2(last layer): " + (" ".join(text(t) for t in last[1][:4]) if len(last) > 1 else "-"),
                  fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(title or f"{path_data['kind']}.L: top singular vectors across depth", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)
