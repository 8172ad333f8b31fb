"""Summaries of the paper's findings measured prompt by prompt on real models (``benchmarks/real_findings.py``
writes the records into ``benchmarks/results/real_models.json``; docs/real-models.md and docs/lens.md quote what is
computed here from them): the share of prompts whose prediction is among the 10 tokens decoded from ``u_1``, with
Wilson intervals and the controls a random vector does not give, the records by the machine that computed them,
the layerwise figures, and the tables of the decoded example and of the lens comparison. Torch-free: the records
are plain JSON values.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from detjac.analysis.lens import wilson


def quantiles(values: list[float]) -> dict[str, float]:
    """Median, 90th percentile, largest and smallest of ``values`` ({} for none)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {}
    return {"median": float(np.median(v)), "p90": float(np.quantile(v, 0.9)), "max": float(v.max()),
            "min": float(v.min())}


def frequent_predictions(token_ids: list[int], common: int) -> list[tuple[int, int]]:
    """The ``common`` most frequent predicted token ids with their counts, most frequent first (ties in order of
    first appearance): the predictions the ``u_1`` and lens controls leave out."""
    return Counter(token_ids).most_common(common)


def u1_controls(rows: list[dict[str, Any]], common: int = 5) -> dict[str, Any]:
    """Two controls for the ``u_1`` hit rate that a random vector does not give: many prompts predict the same
    frequent token, which a direction can hold without being about the prompt. ``other_prompts``: how often another
    prompt's ``u_1`` top 10 holds this prompt's prediction (over ordered pairs of distinct prompts); ``uncommon``:
    the hit rate on the prompts whose prediction is not one of the ``common`` most frequent predictions."""
    n = len(rows)
    pairs = sum(p["next_token_id"] in q["u1_top10"] for p in rows for q in rows if q is not p)
    frequent = frequent_predictions([r["next_token_id"] for r in rows], common)
    rest = [r for r in rows if r["next_token_id"] not in {t for t, _ in frequent}]
    hits = sum(bool(r["u1_hit"]) for r in rest)
    return {
        "other_prompts_u1_top10_rate": {"hits": pairs, "n": n * (n - 1), "rate": pairs / max(1, n * (n - 1))},
        "frequent_predictions": [{"token_id": t, "prompts": c} for t, c in frequent],
        "uncommon_u1_top10_rate": {"hits": hits, "n": len(rest), "rate": hits / max(1, len(rest)),
                                   "ci95": list(wilson(hits, len(rest)))},
    }


def by_host(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The records grouped by the machine that computed them (``"not recorded"``: before records named it): how
    many, their detached reconstruction errors and their mean times. The errors' last bits and the times depend on
    the CPU, so figures pooled over machines are read with this beside them."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r.get("host", "not recorded"), []).append(r)
    return {name: {"prompts": len(g), "recon_detached": quantiles([r["recon_detached"] for r in g]),
                   "seconds_detached": sum(r["seconds_detached"] for r in g) / len(g),
                   "seconds_ordinary": sum(r["seconds_ordinary"] for r in g) / len(g)}
            for name, g in groups.items()}


def findings_summary(entry: dict[str, Any]) -> dict[str, Any]:
    """The summary of a model's findings records (``entry``: its ``prompts``, ``skipped``, ``layerwise`` and
    ``timing``): reconstruction errors, the ``u_1`` hit rates with Wilson intervals and their controls, times, the
    records by host, the spectra's ranks, and per layer the layerwise figures and where the prediction emerges."""
    rows = entry["prompts"]
    out: dict[str, Any] = {"prompts": len(rows), "skipped": len(entry["skipped"])}
    if rows:
        out["recon_detached"] = quantiles([r["recon_detached"] for r in rows])
        out["recon_ordinary"] = quantiles([r["recon_ordinary"] for r in rows])
        for key in ("u1_hit", "ordinary_u1_hit", "random_hit"):
            hits = sum(bool(r[key]) for r in rows)
            out[key.replace("_hit", "_top10_rate")] = {"hits": hits, "n": len(rows), "rate": hits / len(rows),
                                                       "ci95": list(wilson(hits, len(rows)))}
        out.update(u1_controls(rows))
        detached = sum(r["seconds_detached"] for r in rows) / len(rows)
        ordinary = sum(r["seconds_ordinary"] for r in rows) / len(rows)
        total = entry["timing"].get("records", {"seconds": 0.0, "count": 0})
        out["record_seconds"] = {"detached_jacobian": detached, "ordinary_jvp_and_lanczos": ordinary,
                                 "rest": total["seconds"] / max(1, total["count"]) - detached - ordinary}
        out["by_host"] = by_host(rows)
        out["stable_rank"] = quantiles([r["stable_rank"] for r in rows])
        out["n90"] = quantiles([r["n90"] for r in rows])
        out["n99"] = quantiles([r["n99"] for r in rows])
    lw = entry["layerwise"]
    if lw:
        n_layers = len(lw[0]["layers"]) - 1
        by_layer = []
        for layer in range(n_layers + 1):
            vals = [p["layers"][layer] for p in lw]
            by_layer.append({"layer": vals[0]["layer"],
                             **{k: float(np.median([v[k] for v in vals])) for k in ("stable_rank", "n90", "n99")},
                             "hit_rate": sum(v["hit"] for v in vals) / len(vals),
                             "worst_recon": max(v["recon"] for v in vals)})
        def histogram(emergence: list[Any]) -> dict[str, int]:
            return {str(k): emergence.count(k) for k in [*range(n_layers), "output", None] if emergence.count(k)}

        frequent = {f["token_id"] for f in out.get("frequent_predictions", [])}
        predicted = {r["index"]: r["next_token_id"] for r in rows}
        uncommon = [p for p in lw if predicted.get(p["index"]) not in frequent]
        out["layerwise"] = {"prompts": len(lw), "by_layer": by_layer,
                            "emergence_histogram": histogram([p["emergence"] for p in lw]),
                            "uncommon_prompts": len(uncommon),
                            "uncommon_emergence_histogram": histogram([p["emergence"] for p in uncommon])}
        timed = [p for p in lw if "seconds_jacobians" in p]  # the earliest prompts did not record it
        if timed:
            share = sum(p["seconds_jacobians"] for p in timed) / sum(p["seconds"] for p in timed)
            out["layerwise"]["jacobians_share_of_time"] = {"prompts": len(timed), "share": share}
    return out


def example_markdown(example: dict[str, Any], tokenizer: Any, shown: int = 6) -> str:
    """The example's decoded operators as a markdown table: the combined operator's three triplets, then every
    token's top triplet (its ``J_k``), each with ``sigma`` and the first ``shown`` tokens of ``u`` and ``v``."""

    def shown_as(token_id: int) -> str:  # a code span; whitespace-only tokens as their repr, which is visible
        text = tokenizer.decode([token_id])
        return "`" + (repr(text) if not text.strip() else text).replace("`", "'").replace("|", "/") + "`"

    def words(ids: list[int]) -> str:
        return " ".join(shown_as(i) for i in ids[:shown])

    lines = ["| operator | σ | u (output side) | v (input side) |", "|---|---|---|---|"]
    combined = example["combined"]
    for j, sigma in enumerate(combined["sigma"]):
        at = combined["right_positions"][j]
        lines.append(f"| combined #{j + 1} (v at token {at}) | {sigma:.3g} | {words(combined['left_ids'][j])} | "
                     f"{words(combined['right_ids'][j])} |")
    for k, op in enumerate(example["per_token"]):
        lines.append(f"| J_{k} ({shown_as(example['token_ids'][k])}) #1 | {op['sigma'][0]:.3g} | "
                     f"{words(op['left_ids'][0])} | {words(op['right_ids'][0])} |")
    lines += ["", f"Predicted next token: {shown_as(example['next_token_id'])}; reconstruction error "
                  f"{example['recon_detached']:.1e}."]
    return "\n".join(lines)


def lens_comparison_markdown(lens: dict[str, Any], common: int = 5) -> str:
    """The lens comparison as markdown tables: per layer, the share of evaluation prompts whose prediction is the
    reading's top token and among its top 10, for the logit lens and each estimator with detached and ordinary
    Jacobians (from the ``lens_summary.csv`` rows the lens part keeps); then the same on the prompts whose prediction
    is not one of the ``common`` most frequent (from the per-prompt ranks), the control of the ``u_1`` hit rate."""
    done = [est for est in ("same-position", "jlens") if est in lens]
    cells: dict[tuple[str, str, str], str] = {}
    for est in done:
        for row in lens[est]["summary"]:
            cells[est, row["method"], row["layer"]] = (f"{100 * float(row['top1']):.0f} / "
                                                       f"{100 * float(row['top10']):.0f}")
    n = next((row["n"] for est in done for row in lens[est]["summary"]), "?")
    lines = [_lens_table(done, cells), "",
             f"Top-1 / top-10 agreement with the model's prediction, % of {n} evaluation prompts; fitted on "
             f"{lens.get('fit_prompts', '?')} lens prompts."]
    ranked = [est for est in done if "ranks" in lens[est]]
    cells, kept = {}, set()
    for est in ranked:
        predicted = lens[est]["predicted"]
        frequent = {t for t, _ in frequent_predictions(predicted, common)}
        keep = [i for i, t in enumerate(predicted) if t not in frequent]
        kept.add(len(keep))
        for method, grid in lens[est]["ranks"].items():
            for j, layer in enumerate(lens[est]["layers"]):
                got = [grid[i][j] for i in keep]
                cells[est, method, str(layer)] = (f"{100 * sum(r == 1 for r in got) / max(1, len(got)):.0f} / "
                                                  f"{100 * sum(r <= 10 for r in got) / max(1, len(got)):.0f}")
    if ranked and kept != {0}:
        lines += ["", f"The same on the {' / '.join(map(str, sorted(kept)))} evaluation prompts whose prediction is "
                      f"not one of the {common} most frequent predictions among them:", "", _lens_table(ranked, cells)]
    return "\n".join(lines)


def _lens_table(estimators: list[str], cells: dict[tuple[str, str, str], str]) -> str:
    columns = [(estimators[0] if estimators else "same-position", "logit", "logit lens")]  # same prompts for both
    columns += [(est, f"{kind} lens", f"{est} {kind}") for est in estimators for kind in ("detached", "ordinary")]
    layers = sorted({layer for _, _, layer in cells}, key=int)
    lines = ["| layer | " + " | ".join(title for *_, title in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for layer in layers:
        lines.append(f"| {layer} | " + " | ".join(cells.get((est, method, layer), "–") for est, method, _ in columns)
                     + " |")
    return "\n".join(lines)


def lens_evaluation_ranks(out: str | Path) -> dict[str, Any]:
    """What the results keep of a ``detjac lens evaluate`` folder: its ``lens_summary.csv`` rows, and from
    ``lens_rows.csv`` each prompt's prediction and the rank of it in every method's reading by layer (``ranks[method]``
    is prompts x layers, 1 = top), so that a control such as the uncommon predictions can be computed later."""
    import csv

    out = Path(out)
    with open(out / "lens_summary.csv", encoding="utf-8") as handle:
        summary = list(csv.DictReader(handle))
    with open(out / "lens_rows.csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    prompts = {p: i for i, p in enumerate(sorted({int(r["prompt"]) for r in rows}))}
    layers = {layer: j for j, layer in enumerate(sorted({int(r["layer"]) for r in rows}))}
    predicted = {int(r["prompt"]): int(r["predicted"]) for r in rows}
    ranks: dict[str, list[list[int]]] = {}
    for r in rows:
        grid = ranks.setdefault(r["method"], [[0] * len(layers) for _ in prompts])
        grid[prompts[int(r["prompt"])]][layers[int(r["layer"])]] = int(r["rank"])
    if any(0 in row for grid in ranks.values() for row in grid):
        raise ValueError(f"{out / 'lens_rows.csv'}: not every prompt has a row for every layer and method")
    return {"summary": summary, "layers": list(layers), "predicted": [predicted[p] for p in prompts], "ranks": ranks}
