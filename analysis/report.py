"""A corpus-level report of a store: tables (CSV, JSON) and figures (PNG), from stored analyses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from . import jobs


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_corpus_spectra(store: Any, ids: list[str], path: Path) -> None:
    """Every prompt's combined spectrum (thin lines) and their median (thick)."""
    plt = _plt()
    spectra = [store.read_analysis(pid, "spectrum_combined")[0]["S"] for pid in ids]
    length = min(len(s) for s in spectra)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for s in spectra:
        ax.semilogy(np.arange(1, len(s) + 1), s, color="0.75", lw=0.7)
    ax.semilogy(np.arange(1, length + 1), np.median([s[:length] for s in spectra], axis=0), color="black", lw=2,
                label=f"median of {len(spectra)} prompts")
    ax.set(xlabel="singular value index", ylabel="singular value", title="Spectra of [J_1 ... J_n]")
    ax.legend()
    fig.tight_layout()
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
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def report(store: Any, out: str | Path, top: int = 10, progress: Any = None) -> dict[str, Any]:
    """Run dims and a Gram SVD over every prompt (results kept in the store) and write the report to ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = store.prompt_ids()
    dims_rows = jobs.dims(store, ids, progress=progress)
    spectra = jobs.svd(store, ids, k=1, method="gram")
    text = jobs.token_texts(store)
    decoded_rows = []
    for spec in spectra:
        prompt = store.get(spec.prompt_id)
        left = jobs.decode_spectrum(store, spec, top)["left_ids"][0]
        decoded_rows.append({"prompt_id": spec.prompt_id, "prompt": prompt.prompt,
                             "next_token": text(prompt.attrs["next_token_id"]),
                             "u1_tokens": [text(t) for t in left],
                             "u1_hit": int(prompt.attrs["next_token_id"]) in left.tolist()})
    jobs.to_csv(dims_rows, out / "dims.csv")
    jobs.to_csv([{**r, "u1_tokens": " ".join(r["u1_tokens"])} for r in decoded_rows], out / "decoded.csv")
    plot_corpus_spectra(store, ids, out / "spectra.png")
    plot_dims_by_position(dims_rows, out / "dims_by_position.png")
    plot_decoded_table(decoded_rows, out / "decoded.png")
    combined = [r for r in dims_rows if r["token"] == "combined"]
    summary = {"prompts": len(ids), "top": top,
               "prediction_in_u1_top": sum(r["u1_hit"] for r in decoded_rows) / max(1, len(decoded_rows)),
               "median_stable_rank_combined": float(np.median([r["stable_rank"] for r in combined])),
               "median_n90_combined": float(np.median([r["n90"] for r in combined])),
               "files": sorted({p.name for p in out.iterdir()} | {"summary.json"})}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
