"""Faithfulness of the exact attribution graphs on the *unmodified* real models: ablate what the graph names.

For Factbook prompts (``benchmarks/data/factbook_prompts.jsonl``, the evaluation split) on SmolLM2-135M-Instruct and
Gemma 3 270M (float64, dequantized from their GGUF files): the model's top prediction ``t`` is the target; every
MLP neuron's total attribution to its demeaned logit ``logit_t - mean_v logit_v`` comes from one pullback of the
detached model (``detjac.graphs.logit_attribution``). Then the ``k`` neurons (k = 10, 50) with the largest
``|attribution|`` are zeroed in the unmodified model (its own norms, softmaxes and gates recomputed: a forward
pre-hook on each MLP's down projection), and the change of the demeaned target logit is compared with the graph's
prediction, minus the sum of their attributions (exact for the detached model, by linearity). Control: ``k`` random
active neurons of the same layers, at positions up to the predicted one.

Reported per model and k: the Pearson correlation of predicted and actual change over prompts (top-k and random),
the median ratio actual / predicted, and the mean actual change of top-k against random. Results go to
``benchmarks/results/graph_faithfulness.json`` (one record per prompt, then the summary), resumable.

    .venv/bin/python -m benchmarks.graph_faithfulness --models smollm2 --prompts 50
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from detjac.machine import cpu_name

from .support.shipped import SHIPPED, shipped_gguf

RESULTS = Path(__file__).parent / "results" / "graph_faithfulness.json"
PROMPTS = Path(__file__).parent / "data" / "factbook_prompts.jsonl"
KS = (10, 50)


def _prompts(count: int) -> list[str]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [r["text"] for r in rows if r.get("split") == "eval"][:count]


def _demeaned(logits: Any, t: int) -> float:
    return float(logits[t] - logits.mean())


def _ablated_logits(engine: Any, ids: list[int], position: int, neurons: list[tuple[int, int, int]]) -> Any:
    """The unmodified model's logits at ``position`` with each (layer, index, position) neuron set to zero (the input
    of its MLP's down projection)."""
    import torch

    layers = list(engine.model.model.layers)
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for layer, index, pos in neurons:
        by_layer.setdefault(layer, []).append((pos, index))
    handles = []
    for layer, spots in by_layer.items():
        pos_idx = torch.tensor([s[0] for s in spots]), torch.tensor([s[1] for s in spots])

        def zero(_module: Any, args: tuple[Any, ...], pos_idx: Any = pos_idx) -> tuple[Any, ...]:
            x = args[0].clone()
            x[0, pos_idx[0], pos_idx[1]] = 0.0
            return (x, *args[1:])

        handles.append(layers[layer].mlp.down_proj.register_forward_pre_hook(zero))
    try:
        return engine.stock_logits(ids, position)
    finally:
        for h in handles:
            h.remove()


def one_prompt(engine: Any, text: str, rng: np.random.Generator) -> dict[str, Any]:
    from detjac.graphs import logit_attribution, logit_vectors

    trace = engine.trace(text)
    ids, p = list(trace.token_ids), trace.position
    base = engine.stock_logits(ids, p)
    t = int(base.argmax())
    vectors = logit_vectors(engine, trace.output, [t])
    attr = {layer: a[0, :p + 1].cpu().numpy() for layer, a in logit_attribution(engine, trace, vectors)}  # (p+1, N)
    flat = np.concatenate([attr[layer].ravel() for layer in sorted(attr)])
    widths = [attr[layer].size for layer in sorted(attr)]
    starts = np.cumsum([0, *widths[:-1]])
    n_neurons = {layer: attr[layer].shape[1] for layer in attr}

    def unflat(i: int) -> tuple[int, int, int]:
        layer = int(np.searchsorted(starts, i, side="right") - 1)
        within = int(i - starts[layer])
        return layer, within % n_neurons[layer], within // n_neurons[layer]

    record: dict[str, Any] = {"prompt": text, "tokens": len(ids), "target": t,
                              "target_text": engine.tokenizer.decode([t]), "base": _demeaned(base, t)}
    order = np.argsort(-np.abs(flat))
    for k in KS:
        top = [unflat(int(i)) for i in order[:k]]
        predicted = -float(flat[order[:k]].sum())
        actual = _demeaned(_ablated_logits(engine, ids, p, top), t) - record["base"]
        layers = [n[0] for n in top]
        random = []
        for layer in layers:  # the same layers, random active neurons at positions up to the predicted one
            active = np.flatnonzero(attr[layer].ravel() != 0)
            j = int(rng.choice(active))
            random.append((layer, j % n_neurons[layer], j // n_neurons[layer]))
        r_pred = -float(sum(attr[layer][pos, idx] for layer, idx, pos in random))
        r_act = _demeaned(_ablated_logits(engine, ids, p, random), t) - record["base"]
        record[f"top{k}"] = {"predicted": predicted, "actual": actual}
        record[f"random{k}"] = {"predicted": r_pred, "actual": r_act}
    return record


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"prompts": len(records)}
    for k in KS:
        for kind in ("top", "random"):
            pred = np.array([r[f"{kind}{k}"]["predicted"] for r in records])
            act = np.array([r[f"{kind}{k}"]["actual"] for r in records])
            ratio = act / np.where(pred != 0, pred, np.nan)
            out[f"{kind}{k}"] = {
                "pearson": float(np.corrcoef(pred, act)[0, 1]) if len(records) > 2 else None,
                "median_actual_over_predicted": float(np.nanmedian(ratio)),
                "mean_actual": float(act.mean()), "mean_predicted": float(pred.mean()),
            }
    return out


def main() -> None:
    import torch

    from detjac.engine import load_engine

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHIPPED), choices=SHIPPED)
    parser.add_argument("--prompts", type=int, default=50)
    args = parser.parse_args()
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for model in args.models:
        entry = data.setdefault(model, {"records": []})
        done = {r["prompt"] for r in entry["records"]}
        engine = load_engine(str(shipped_gguf(model)), dtype=torch.float64)
        rng = np.random.default_rng(len(done))
        for i, text in enumerate(_prompts(args.prompts)):
            if text in done:
                continue
            start = time.perf_counter()
            entry["records"].append(one_prompt(engine, text, rng))
            entry["summary"] = summary(entry["records"])
            entry.update(cpu=cpu_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
            RESULTS.write_text(json.dumps(data, indent=1) + "\n")
            r = entry["records"][-1]
            print(f"{model} {i + 1}: {time.perf_counter() - start:.1f} s, top10 predicted {r['top10']['predicted']:.3f}"
                  f" actual {r['top10']['actual']:.3f}", flush=True)
        print(model, json.dumps(entry.get("summary"), indent=1), flush=True)


if __name__ == "__main__":
    main()
