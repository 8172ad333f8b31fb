"""Detached against ordinary Jacobians of the same prompts, from two stores."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidArgumentError
from ..store import model_differences
from .jobs import write_table
from .spectra import decode, dimensionality, singular_values, stored_svd

if TYPE_CHECKING:
    from ..store import StoredPrompt, StoreReader


def _summary(store: StoreReader, prompt: StoredPrompt, top: int, unembed: np.ndarray) -> dict[str, Any]:
    s = singular_values(prompt)
    spec = stored_svd(prompt, 1, method="gram")
    ids, _ = decode(spec.U, unembed, top)
    d = dimensionality(s)
    return {"error": float(prompt.attrs["reconstruction_error"]), "sigma_1": float(s[0]),
            "stable_rank": d.stable_rank, "n90": d.n90,
            "u1_hit": int(prompt.attrs["next_token_id"]) in ids[0].tolist(), "spectrum": s}


def _name(store: StoreReader, fallback: str) -> str:
    path = getattr(store, "path", None)
    return Path(path).name if path is not None else fallback


def compare(detached: StoreReader, ordinary: StoreReader, top: int = 10) -> list[dict[str, Any]]:
    """One row per prompt present in both stores (matched by text): errors, sigma_1, stable rank, n90,
    and whether the prediction is among the top decoded tokens of the combined operator's ``u_1``."""
    if detached.run.get("detach") is False or ordinary.run.get("detach") is not False:
        raise InvalidArgumentError("Expected a detached store first and an ordinary one (detjac run --ordinary) "
                                   f"second. Got detach={detached.run.get('detach')} and "
                                   f"{ordinary.run.get('detach')}.")
    differences = model_differences(detached.run, ordinary.run, (_name(detached, "first"), _name(ordinary, "second")))
    if differences:
        raise InvalidArgumentError(f"Expected two stores of the same model. Got {detached.run.get('model_id')} and "
                                   f"{ordinary.run.get('model_id')}, which differ in " + "; ".join(differences) + ".")
    by_text = {p.prompt: p for p in ordinary}
    unembed = detached.model_array("unembedding")
    rows = []
    for prompt in detached:
        other = by_text.get(prompt.prompt)
        if other is None:
            continue
        det, ordi = _summary(detached, prompt, top, unembed), _summary(ordinary, other, top, unembed)
        rows.append({"prompt_id": prompt.id, "prompt": prompt.prompt,
                     **{f"detached_{k}": v for k, v in det.items()},
                     **{f"ordinary_{k}": v for k, v in ordi.items()}})
    if not rows:
        raise InvalidArgumentError("Expected prompts common to both stores. Got none (prompts are matched by text).")
    return rows


def plot_compare(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Reconstruction errors per prompt (log scale) and the first prompt's two spectra."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = np.arange(len(rows))
    ax1.bar(x - 0.2, [r["detached_error"] for r in rows], 0.4, label="detached")
    ax1.bar(x + 0.2, [r["ordinary_error"] for r in rows], 0.4, label="ordinary")
    ax1.set(yscale="log", xlabel="prompt", ylabel="||sum_k J_k x_k - y|| / ||y||", title="Reconstruction error")
    ax1.legend()
    first = rows[0]
    for key, style in (("detached", "-"), ("ordinary", "--")):
        s = first[f"{key}_spectrum"]
        ax2.semilogy(np.arange(1, len(s) + 1), s, style, label=key)
    ax2.set(xlabel="singular value index", ylabel="singular value", title=f"[J_1 ... J_n]: {first['prompt'][:40]!r}")
    ax2.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from .glyphs import make_drawable

    make_drawable(fig)  # token texts: never a missing-glyph warning
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@dataclass(frozen=True)
class CompareReport:
    """:func:`compare`'s rows, how many prompts have the prediction among the top decoded tokens of ``u_1``
    (``hits``: detached, ordinary), and the files written (``plot``, ``table`` when asked for)."""

    rows: list[dict[str, Any]]
    top: int
    hits: tuple[int, int]
    plot: Path
    table: Path | None = None


def compare_report(detached: StoreReader, ordinary: StoreReader, top: int = 10, plot: str | Path = "detjac-compare.png",
                   table: str | Path | None = None) -> CompareReport:
    """Compare two stores of the same prompts (:func:`compare`) and write the figure and, optionally, the table.

    Parameters
    ----------
    detached, ordinary : StoreReader
        Stores written by ``detjac run`` and by ``detjac run --ordinary``; prompts matched by text.
    top : int
        Decoded tokens of ``u_1`` searched for the prediction.
    plot : str or Path
        The figure (:func:`plot_compare`).
    table : str or Path or None
        The rows without the spectra (Parquet for a ``.parquet`` suffix, else CSV).

    Returns
    -------
    CompareReport

    Raises
    ------
    InvalidArgumentError
        When the stores are not a detached and an ordinary one, in that order, or share no prompt.
    """
    rows = compare(detached, ordinary, top)
    hits = (sum(r["detached_u1_hit"] for r in rows), sum(r["ordinary_u1_hit"] for r in rows))
    figure = plot_compare(rows, plot)
    written = None
    if table:
        written = write_table([{k: v for k, v in r.items() if not k.endswith("spectrum")} for r in rows], table)
    return CompareReport(rows, top, hits, figure, written)
