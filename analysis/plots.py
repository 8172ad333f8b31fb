"""Figures of detached-Jacobian spectra (matplotlib, Agg backend; numpy in, PNG/SVG out)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
