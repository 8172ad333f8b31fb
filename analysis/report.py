"""A corpus-level report of a store: tables (CSV, JSON) and figures (PNG), from stored analyses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidArgumentError
from . import jobs, layers
from .plots import plot_emergence, plot_layer_dims
from .plots import pyplot as _plt

if TYPE_CHECKING:
    from ..store import StoreReader


def plot_corpus_spectra(store: StoreReader, ids: list[str], path: Path) -> None:
    """Every prompt's combined spectrum (thin lines) and their median (thick)."""
    plt = _plt()
    spectra = [jobs.read_spectrum(store.analyses, pid, None) for pid in ids]
    length = min(len(s) for s in spectra)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for s in spectra:
        ax.semilogy(np.arange(1, len(s) + 1), s, color="0.75", lw=0.7)
    ax.semilogy(np.arange(1, length + 1), np.median([s[:length] for s in spectra], axis=0), color="black", lw=2,
                label=f"median of {len(spectra)} prompts")
    ax.set(xlabel="singular value index", ylabel="singular value", title="Spectra of [J_1 ... J_n]")
    ax.legend()
    fig.tight_layout()
    from .glyphs import make_drawable

    make_drawable(fig)  # token texts: never a missing-glyph warning
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_dims_by_position(rows: list[dict[str, Any]], path: Path) -> None:
    """Mean stable rank and participation ratio of J_k by token position (from the end of the prompt)."""
    plt = _plt()
    per_prompt: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["token"] != "combined":
            per_prompt.setdefault(r["prompt_id"], []).append(r)
    depth = max(len(v) for v in per_prompt.values())
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for key, label in (("stable_rank", "stable rank"), ("participation_ratio", "participation ratio")):
        means = []
        for back in range(1, depth + 1):  # position counted from the last token
            values = [v[-back][key] for v in per_prompt.values() if len(v) >= back]
            means.append(np.mean(values))
        ax.plot(-np.arange(1, depth + 1), means, "o-", ms=3, label=label)
    ax.set(xlabel="token position (from the end; -1 = last)", ylabel="mean over prompts",
           title="Dimensionality of the per-token operators J_k")
    ax.legend()
    fig.tight_layout()
    from .glyphs import make_drawable

    make_drawable(fig)  # token texts: never a missing-glyph warning
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_decoded_table(rows: list[dict[str, Any]], path: Path, limit: int = 12) -> None:
    """The first ``limit`` prompts, their prediction and the top tokens of u_1, as a figure."""
    plt = _plt()
    shown = rows[:limit]
    cells = [[r["prompt"][:48], r["next_token"], " ".join(r["u1_tokens"][:6])] for r in shown]
    fig, ax = plt.subplots(figsize=(12, 0.42 * len(cells) + 0.9))
    ax.axis("off")
    table = ax.table(cellText=cells, colLabels=["prompt", "next token", "u_1 of [J_1 ... J_n], decoded"],
                     loc="center", cellLoc="left", colWidths=[0.42, 0.12, 0.46])
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    for i, r in enumerate(shown, start=1):
        if r["u1_hit"]:
            table[i, 2].set_facecolor("#dff0d8")
    ax.set_title("Decoded left singular vectors (green: the prediction is among the top 10)", fontsize=9)
    from .glyphs import make_drawable

    make_drawable(fig)  # token texts: never a missing-glyph warning
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def analysis_report(store: StoreReader, out: str | Path, top: int = 10, progress: Any = None,
           table_format: str = "csv") -> dict[str, Any]:
    """Run dims and a Gram SVD over every prompt (results kept in the store) and write the report to ``out``.

    Tables are CSV, or Parquet with ``table_format="parquet"``. Prompts stored with layerwise
    Jacobians add the layerwise tables and figures of :mod:`detjac.analysis.layers`.
    """
    if table_format not in ("csv", "parquet"):
        raise InvalidArgumentError(f"Expected table_format 'csv' or 'parquet'. Got {table_format!r}.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jobs.require_full(store, "analyze report")
    ids = store.prompt_ids()
    opened = jobs.OpenedPrompts(store)  # each prompt opened once, for its spectra, its triplets and its row
    dims_rows = jobs.dims(store, ids, progress=progress, opened=opened)
    spectra = jobs.prompt_svds(store, ids, k=1, method="gram", opened=opened)
    text = jobs.piece_reader(store)
    decoder = jobs.SpectrumDecoder(store)
    decoded_rows = []
    for spec in spectra:
        prompt = opened(spec.prompt_id)
        left = decoder.decode(spec, top).left_ids[0]
        decoded_rows.append({"prompt_id": spec.prompt_id, "prompt": prompt.prompt,
                             "next_token": text(prompt.attrs["next_token_id"]),
                             "u1_tokens": [text(t) for t in left],
                             "u1_hit": int(prompt.attrs["next_token_id"]) in left.tolist()})
    jobs.write_table(dims_rows, out / f"dims.{table_format}")
    jobs.write_table(decoded_rows, out / f"decoded.{table_format}")
    plot_corpus_spectra(store, ids, out / "spectra.png")
    plot_dims_by_position(dims_rows, out / "dims_by_position.png")
    plot_decoded_table(decoded_rows, out / "decoded.png")
    combined = [r for r in dims_rows if r["token"] == "combined"]
    summary = {"prompts": len(ids), "top": top,
               "prediction_in_u1_top": sum(r["u1_hit"] for r in decoded_rows) / max(1, len(decoded_rows)),
               "median_stable_rank_combined": float(np.median([r["stable_rank"] for r in combined])),
               "median_n90_combined": float(np.median([r["n90"] for r in combined])),
               **_layerwise_section(store, ids, out, top, table_format, opened),
               "files": sorted({p.name for p in out.iterdir()} | {"summary.json"})}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _layerwise_section(store: StoreReader, ids: list[str], out: Path, top: int, table_format: str,
                       opened: jobs.OpenedPrompts) -> dict[str, Any]:
    """Layer tables and figures for the prompts stored with layerwise Jacobians; their summary figures."""
    with_layers = [pid for pid in ids if opened(pid).layerwise_targets]
    if not with_layers:
        return {}
    rows = layers.layer_table(store, with_layers, top=top)
    emerged = layers.emergence(rows)
    jobs.write_table(rows, out / f"layers.{table_format}")
    jobs.write_table(emerged, out / f"emergence.{table_format}")
    plot_layer_dims(rows, out / "layer_dims.png")
    plot_emergence(rows, out / "emergence.png", top)
    first = [e["first_layer_u1"] for e in emerged if e["component"] == "layer" and e["first_layer_u1"] >= 0]
    return {"layerwise_prompts": len(with_layers),
            "prediction_emerges_in_u1": len(first) / max(1, sum(e["component"] == "layer" for e in emerged)),
            "median_first_layer_u1": float(np.median(first)) if first else None}
