"""Is exact better? detjac's attributions against attribution patching and integrated gradients, scored on the same
ablations of the *unmodified* model (docs/results/2026-11-28-attribution-vs-peers.md).

For each held-out prompt on SmolLM2-135M-Instruct and Gemma 3 270M (float64, dequantized from their GGUF files), the
target is the model's top prediction ``t`` at the last position: its demeaned logit (and its log-probability).
Units: MLP neurons ``(layer, position, index)`` and attention heads ``(layer, head)`` (a head's output at every
position). Baselines: zero, and the unit's mean over a reference corpus. Methods (:data:`METHODS`), each predicting
the target's change when a unit is set to the baseline (:mod:`benchmarks.support.peers`):

- ``detjac_total``: ``(b - a) · ∂m/∂a`` in the detached model (attention probabilities, norm scales, gates frozen),
  every path: the graph's ranking pullback; ``detjac_direct``: the same with every MLP's output held fixed, the
  graph's edge into the logit;
- ``atp``: ``(b - a) · ∂m/∂a`` in the unmodified model (attribution patching);
- ``ig``: integrated gradients of the unmodified model, ``--steps`` midpoints, every unit of the kind (all layers, all
  positions) moved together from the baseline to the prompt's values (the joint path);
- ``ig_layer``: the same one layer's units at a time, the other layers recomputed (``n_layers`` times IG's cost; not
  in a run's default methods: ``--add ig_layer --prompts N`` adds it to the first N records);
- ``detjac_path_layer``: ``detjac_path`` along ``ig_layer``'s paths (the same cost; added the same way);
- ``detjac_path``: detjac's attribution averaged along IG's path (``--steps`` midpoints, the model detached at each
  point: issue 68's remedy candidate); ``--add detjac_path`` adds it to the records already written (the same
  units, its own deletion curve), without recomputing the rest;
- ``random``: a random ranking (and random predictions, for the correlations' floor).

Ground truth: the unmodified model with the unit set to the baseline, norms, softmaxes and gates recomputed. Neurons:
the top ``--top`` of each method by |predicted change| plus ``--random`` random active neurons are ablated one at a
time; heads: every head. Deletion curves: each method's top-k units by predicted *drop* ablated together (k in
:data:`KS`), against the true top-k by single-unit drop and a random k.

Prompts: ``benchmarks/data/heldout_prompts.txt`` (prefixes of held-out dictionary entries, used to tune nothing
here), in file order, each cut to its longest prefix of whole words of at most ``MAX_TOKENS`` tokens, kept when it
has at least ``MIN_TOKENS``. Mean-ablation corpus: the first ``REFERENCE`` lines of
``benchmarks/data/lens_fit_prompts.txt`` (the lens-fit prompts, disjoint from the held-out ones; checked).

Records go to ``benchmarks/results/attribution_vs_peers.{model}.jsonl``, one line per (model, prompt), appended as
each prompt finishes; a run resumes after a kill without recomputing them, and refuses to add to records made with
other settings. ``--summary`` scores the records into ``benchmarks/results/attribution_vs_peers.json`` and draws
``docs/attribution-vs-peers.png``. A run with other ``--top``/``--random`` than the defaults (200, 200) keeps its own
files, named with them (``attribution_vs_peers.{model}.top50-random50.jsonl``, ``...top50-random50.json``,
``attribution-vs-peers.top50-random50.png``): ``--summary`` takes the same options to score them.

    .venv/bin/python -m benchmarks.attribution_vs_peers --models smollm2 gemma3 --prompts 100
    .venv/bin/python -m benchmarks.attribution_vs_peers --add detjac_path     # to the records already written
    .venv/bin/python -m benchmarks.attribution_vs_peers --add ig_layer --prompts 10   # to the first 10 records
    .venv/bin/python -m benchmarks.attribution_vs_peers --summary
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from detjac.machine import cpu_name

from .support.shipped import SHIPPED, shipped_gguf

HERE = Path(__file__).parent
RECORDS = HERE / "results" / "attribution_vs_peers.{model}{tag}.jsonl"
SUMMARY = HERE / "results" / "attribution_vs_peers{tag}.json"
PLOT = HERE.parent / "docs" / "attribution-vs-peers{tag}.png"
PROMPTS = HERE / "data" / "heldout_prompts.txt"
REFERENCE_FILE = HERE / "data" / "lens_fit_prompts.txt"
REFERENCE = 64
MIN_TOKENS, MAX_TOKENS = 5, 7
METHODS = ("detjac_total", "detjac_direct", "atp", "ig", "detjac_path", "ig_layer", "detjac_path_layer", "random")
PER_LAYER = ("ig_layer", "detjac_path_layer")  # one layer's path at a time: n_layers x the cost, added to a few records
DEFAULT_METHODS = tuple(m for m in METHODS if m not in PER_LAYER)
PATH_METHODS = ("ig", "detjac_path", *PER_LAYER)  # integrated along the path from the baseline; --add takes these
BASELINES = ("zero", "mean")
KS = (1, 2, 5, 10, 20, 50, 100, 200)
DEFAULT_TOP = DEFAULT_RANDOM = 200
SETTINGS = ("top", "random", "steps")  # what every record of one file shares


def tag(args: argparse.Namespace) -> str:
    """The part of the file names that says the run's --top/--random ("" for the defaults)."""
    if (args.top, args.random) == (DEFAULT_TOP, DEFAULT_RANDOM):
        return ""
    return f".top{args.top}-random{args.random}"


def check_settings(records: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    """Refuse to mix settings in one file: every record must have been made with ``args``' SETTINGS."""
    want = {k: getattr(args, k) for k in SETTINGS}
    for r in records:
        got = {k: r.get(k) for k in SETTINGS}
        if got != want:
            raise SystemExit(f"Expected the records in {path} to have been made with {want}. Got one made with "
                             f"{got} (prompt {r.get('prompt')!r}): run with those settings, or move the file aside.")


def check_names(given: list[str], known: tuple[str, ...], what: str) -> list[str]:
    unknown = [g for g in given if g not in known]
    if unknown:
        raise SystemExit(f"Expected {what} among {', '.join(known)}. Got {', '.join(map(repr, unknown))}.")
    return given


def short_prompts(tokenizer: Any, lines: list[str], count: int) -> list[str]:
    """The first ``count`` prompts: each line's longest prefix of whole words of at most MAX_TOKENS tokens, kept
    when it has at least MIN_TOKENS."""
    out: list[str] = []
    for line in lines:
        words = line.split()
        best = ""
        for j in range(1, len(words) + 1):
            text = " ".join(words[:j])
            if len(tokenizer(text)["input_ids"]) > MAX_TOKENS:
                break
            best = text
        if best and len(tokenizer(best)["input_ids"]) >= MIN_TOKENS:
            out.append(best)
        if len(out) == count:
            break
    return out


def _lines(path: Path) -> list[str]:
    return [s.strip() for s in path.read_text().splitlines() if s.strip()]


def _top(pred: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-np.abs(pred), kind="stable")[:k]


def one_kind(model: Any, ids: list[int], t: int, kind: str, base: dict[str, list[Any]], args: argparse.Namespace,
             rng: np.random.Generator, seconds: dict[str, float]) -> dict[str, Any]:
    """Every method's predictions and the ablations of one unit kind (see the module docstring)."""
    import torch

    from .support import peers

    def timed(name: str, fn: Any) -> Any:
        start = time.perf_counter()
        out = fn()
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        return out

    grads = {"detjac_total": timed("detjac_total", lambda: peers.gradients(model, ids, t, kind, "detached")),
             "detjac_direct": timed("detjac_direct", lambda: peers.gradients(model, ids, t, kind, "cut")),
             "atp": timed("atp", lambda: peers.gradients(model, ids, t, kind, "real"))}
    acts = grads["atp"].acts
    clean = grads["atp"].metrics.cpu().numpy()
    out: dict[str, Any] = {}
    n_units = peers.unit_count(model, kind, len(ids))
    for b in BASELINES:
        pred: dict[str, np.ndarray] = {}
        for m in ("detjac_total", "detjac_direct", "atp"):
            pred[m] = peers.first_order(model, grads[m], kind, base[b]).reshape(2, -1).cpu().numpy()
        for m in PATH_METHODS:
            if m in args.methods:
                pred[m] = timed(m, lambda b=b, m=m: path_prediction(model, ids, t, kind, base[b], acts, args, m))
        pred["random"] = rng.standard_normal((2, n_units))
        ranked = [m for m in args.methods if m != "random"]
        if kind == "heads":
            units = np.arange(n_units)
        else:
            chosen = set(int(u) for m in ranked for u in _top(pred[m][0], args.top))
            extra = rng.permutation(n_units)[:args.random]
            units = np.array(sorted(chosen | set(int(u) for u in extra)))
        start = time.perf_counter()
        single = peers.ablate(model, ids, t, kind, [[int(u)] for u in units], base[b], batch=args.batch)
        seconds["ablation"] = seconds.get("ablation", 0.0) + time.perf_counter() - start
        actual = single - clean  # (U, 2)
        ks = [k for k in KS if k <= len(units)]
        orders = {m: np.argsort(pred[m][0], kind="stable") for m in ranked}  # the most negative predicted change first
        orders["true"] = units[np.argsort(actual[:, 0], kind="stable")]
        orders["random"] = rng.permutation(units if kind == "neurons" else n_units)
        curves = deletion_curves(model, ids, t, kind, orders, ks, base[b], clean, args)
        out[b] = {"units": units.tolist(), "actual": actual.round(6).tolist(),
                  "predicted": {m: pred[m][:, units].T.round(6).tolist() for m in pred},
                  "ks": ks, "deletion": curves}
    del torch
    return out


def deletion_curves(model: Any, ids: list[int], t: int, kind: str, orders: dict[str, np.ndarray], ks: list[int],
                    base: list[Any], clean: np.ndarray, args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """Each order's deletion curve: its first k units ablated together, for each k of ``ks``; the targets' change
    from ``clean`` (k, 2)."""
    from .support import peers

    groups = [[int(u) for u in orders[m][:k]] for m in orders for k in ks]
    deleted = peers.ablate(model, ids, t, kind, groups, base, batch=args.batch) - clean
    return {m: deleted[j * len(ks):(j + 1) * len(ks)].round(6).tolist() for j, m in enumerate(orders)}


def path_prediction(model: Any, ids: list[int], t: int, kind: str, base: list[Any], acts: list[Any],
                    args: argparse.Namespace, method: str) -> np.ndarray:
    """(2, units) the predictions of a path method: ``ig`` (the unmodified model, every layer moved together),
    ``ig_layer`` (the same, one layer at a time), ``detjac_path`` (detached at each point of the joint path) or
    ``detjac_path_layer`` (detached at each point of the one-layer paths)."""
    from .support import peers

    return peers.integrated_gradients(model, ids, t, kind, base, steps=args.steps, acts=acts,
                                      joint=method not in PER_LAYER,
                                      mode="detached" if method.startswith("detjac_path") else "real"
                                      ).reshape(2, -1).cpu().numpy()


def add_method(model: Any, record: dict[str, Any], method: str, base: dict[str, dict[str, list[Any]]],
               args: argparse.Namespace) -> dict[str, float]:
    """Put ``method``'s predictions of the units ``record`` ablated, and its deletion curve, into ``record`` (the
    rest as recorded); returns its seconds and those of its deletion ablations."""
    from .support import peers

    ids, t, seconds = record["token_ids"], record["target"], {}
    for kind in ("neurons", "heads"):
        acts = peers.gradients(model, ids, t, kind, "real").acts
        for b in BASELINES:
            part = record[kind][b]
            start = time.perf_counter()
            pred = path_prediction(model, ids, t, kind, base[kind][b], acts, args, method)
            seconds[method] = seconds.get(method, 0.0) + time.perf_counter() - start
            units = np.array(part["units"])
            part["predicted"][method] = pred[:, units].T.round(6).tolist()
            start = time.perf_counter()
            part["deletion"] |= deletion_curves(model, ids, t, kind, {method: np.argsort(pred[0], kind="stable")},
                                                part["ks"], base[kind][b], np.array(record["clean"]), args)
            seconds["ablation"] = seconds.get("ablation", 0.0) + time.perf_counter() - start
    return seconds


def one_prompt(model: Any, tokenizer: Any, text: str, base: dict[str, dict[str, list[Any]]],
               args: argparse.Namespace, index: int) -> dict[str, Any]:
    import torch

    from .support import peers

    ids = list(tokenizer(text)["input_ids"])
    with torch.no_grad():
        logits = peers._last_logits(model, ids)
    t = int(logits[0].argmax())
    clean = peers.target_metrics(logits, t)[0].tolist()
    rng = np.random.default_rng(index)
    seconds: dict[str, float] = {}
    record: dict[str, Any] = {"prompt": text, "index": index, "token_ids": ids, "target": t,
                              "target_text": tokenizer.decode([t]), "clean": clean}
    for kind in ("neurons", "heads"):
        record[kind] = one_kind(model, ids, t, kind, base[kind], args, rng, seconds)
    record["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
    return record


def records_path(model: str, args: argparse.Namespace) -> Path:
    return Path(str(RECORDS).format(model=model, tag=tag(args)))


def done_prompts(model: str, args: argparse.Namespace) -> set[str]:
    records = [r for r in load_records(model, args) if r.get("model") == model]
    check_settings(records, args, records_path(model, args))
    return {r["prompt"] for r in records}


def run(args: argparse.Namespace) -> None:
    import torch

    from detjac.engine import load_engine

    from .support import peers

    if args.threads:
        torch.set_num_threads(args.threads)
    held, reference = _lines(PROMPTS), _lines(REFERENCE_FILE)[:REFERENCE]
    overlap = set(held) & set(reference)
    assert not overlap, overlap  # the data files are fixed; held-out and reference prompts never meet
    for name in args.models:
        engine = load_engine(str(shipped_gguf(name)), dtype=torch.float64)
        model, tokenizer = engine.model, engine.tokenizer
        prompts = short_prompts(tokenizer, held, args.prompts)
        done = done_prompts(name, args)
        if len(done) >= len(prompts):
            print(f"{name}: {len(done)} prompts done", flush=True)
            continue
        ref_ids = [list(tokenizer(s)["input_ids"]) for s in reference]
        base = {kind: {"zero": [torch.zeros_like(m) for m in peers.site_means(model, ref_ids[:1], kind)],
                       "mean": peers.site_means(model, ref_ids, kind)} for kind in ("neurons", "heads")}
        for i, text in enumerate(prompts):
            if text in done:
                continue
            start = time.perf_counter()
            record = one_prompt(model, tokenizer, text, base, args, i)
            record.update(model=name, seconds_total=round(time.perf_counter() - start, 2), cpu=cpu_name(),
                          torch=torch.__version__, dtype="float64", steps=args.steps, top=args.top,
                          random=args.random, date=time.strftime("%Y-%m-%d"))
            with records_path(name, args).open("a") as f:  # one line per prompt: a kill loses only the prompt under way
                f.write(json.dumps(record) + "\n")
            print(f"{name} {i + 1}/{len(prompts)} {text!r} -> {record['target_text']!r}: "
                  f"{record['seconds_total']:.1f} s {record['seconds']}", flush=True)


def add_to_records(args: argparse.Namespace) -> None:
    """``--add``: each record without one of ``args.add`` gets it (:func:`add_method`); the file is replaced after
    every prompt, so a kill loses only the prompt under way."""
    import torch

    from detjac.engine import load_engine

    from .support import peers

    if args.threads:
        torch.set_num_threads(args.threads)
    reference = _lines(REFERENCE_FILE)[:REFERENCE]
    for name in args.models:
        records = load_records(name, args)
        check_settings(records, args, records_path(name, args))
        todo = [i for i, r in enumerate(records[:args.prompts])  # the first --prompts records
                if any(m not in r["neurons"]["zero"]["predicted"] for m in args.add)]
        if not todo:
            print(f"{name}: every record has {', '.join(args.add)}", flush=True)
            continue
        engine = load_engine(str(shipped_gguf(name)), dtype=torch.float64)
        model, tokenizer = engine.model, engine.tokenizer
        ref_ids = [list(tokenizer(s)["input_ids"]) for s in reference]
        base = {kind: {"zero": [torch.zeros_like(m) for m in peers.site_means(model, ref_ids[:1], kind)],
                       "mean": peers.site_means(model, ref_ids, kind)} for kind in ("neurons", "heads")}
        for i in todo:
            record = records[i]
            for method in args.add:
                if method not in record["neurons"]["zero"]["predicted"]:
                    spent = add_method(model, record, method, base, args)
                    record.setdefault("added_seconds", {})[method] = {k: round(v, 3) for k, v in spent.items()}
                    record.setdefault("added_steps", {})[method] = args.steps
            path = records_path(name, args)
            partial = path.with_suffix(".partial")
            partial.write_text("".join(json.dumps(r) + "\n" for r in records))
            partial.replace(path)
            print(f"{name} {i + 1}/{len(records)} {record['prompt']!r}: added {', '.join(args.add)} "
                  f"{record['added_seconds']}", flush=True)


def _ranks(x: np.ndarray) -> np.ndarray:
    r = np.empty(len(x))
    r[np.argsort(x, kind="stable")] = np.arange(len(x))
    return r


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def _precision(pred: np.ndarray, actual: np.ndarray, k: int) -> float:
    k = min(k, len(pred))
    return len(set(_top(pred, k).tolist()) & set(_top(actual, k).tolist())) / k


def scores(records: list[dict[str, Any]], kind: str, baseline: str) -> dict[str, Any]:
    """Every method's scores on one unit kind and baseline over ``records`` (see the module docstring): the median
    over prompts of Pearson and Spearman (predicted against actual change, over the ablated units), the mean
    precision at 10 and 50, for both targets; the deletion curves (the target's mean drop over prompts) and their
    normalized area (true top-k by single-unit ablation 1, random 0). A method added to some records only
    (``--add ... --prompts N``) is scored over those, its area normalized by their true and random curves; its
    ``prompts`` says how many."""
    parts = [r[kind][baseline] for r in records]
    common = min(len(p["ks"]) for p in parts)  # the k every prompt's curves reach (a prompt ablating fewer units stops
    # earlier)
    out: dict[str, Any] = {"prompts": len(records), "ks": parts[0]["ks"][:common],
                           "units_ablated_mean": float(np.mean([len(p["units"]) for p in parts])),
                           "methods": {}}

    def curve(m: str, among: list[dict[str, Any]]) -> np.ndarray:
        return np.mean([np.array(p["deletion"][m])[:common, 0] for p in among], axis=0) * -1

    methods = list(dict.fromkeys(m for p in parts for m in p["predicted"]))  # in first-seen order
    for m in methods:
        among = [p for p in parts if m in p["predicted"]]
        row: dict[str, Any] = {"prompts": len(among)}
        for j, target in enumerate(("logit", "logprob")):
            pairs = [(np.array(p["predicted"][m])[:, j], np.array(p["actual"])[:, j]) for p in among]
            row[target] = {
                "pearson": float(np.nanmedian([_pearson(x, y) for x, y in pairs])),
                "spearman": float(np.nanmedian([_pearson(_ranks(x), _ranks(y)) for x, y in pairs])),
                "precision_at_10": float(np.mean([_precision(x, y, 10) for x, y in pairs])),
                "precision_at_50": float(np.mean([_precision(x, y, 50) for x, y in pairs])),
            }
        if all(m in p["deletion"] for p in among):
            c, true, rand = curve(m, among), curve("true", among).mean(), curve("random", among).mean()
            row["deletion_drop"] = c.round(4).tolist()
            row["deletion_area"] = round(float(c.mean()), 4)
            span = true - rand
            row["deletion_area_normalized"] = round((float(c.mean()) - rand) / span, 3) if span else None
        out["methods"][m] = row
    true = curve("true", parts)
    out["true"] = {"deletion_drop": true.round(4).tolist(), "deletion_area": round(float(true.mean()), 4)}
    return out


def _costs(records: list[dict[str, Any]]) -> dict[str, float]:
    names = sorted({k for r in records for k in r["seconds"]})
    return {k: round(float(np.mean([r["seconds"].get(k, 0.0) for r in records])), 2) for k in names} | {
        "total": round(float(np.mean([r["seconds_total"] for r in records])), 2)}


def _added_costs(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each added method's mean seconds (its predictions, its deletion ablations) over the records it was added to."""
    added = [r["added_seconds"] for r in records if "added_seconds" in r]
    methods = sorted({m for a in added for m in a})
    return {m: {k: round(float(np.mean([a[m][k] for a in added if m in a and k in a[m]])), 2)
                for k in sorted({k for a in added if m in a for k in a[m]})} | {"prompts": sum(m in a for a in added)}
            for m in methods}


def load_records(model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The records of ``model`` at ``args``' --top/--random (a line cut by a kill is skipped: recomputed)."""
    path = records_path(model, args)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def write_summary(args: argparse.Namespace) -> dict[str, Any]:
    """Score every model's records into SUMMARY, draw PLOT, and print the tables (markdown)."""
    models = args.models
    summary: dict[str, Any] = {"records": {m: str(records_path(m, args).relative_to(HERE.parent)) for m in models}}
    for model in models:
        records = load_records(model, args)
        if not records:
            continue
        check_settings(records, args, records_path(model, args))
        entry: dict[str, Any] = {"prompts": len(records), "seconds_per_prompt": _costs(records),
                                 "added_seconds_per_prompt": _added_costs(records), "cpu": records[-1]["cpu"],
                                 "steps": records[-1]["steps"], "top": records[-1]["top"],
                                 "random": records[-1]["random"]}
        for kind in ("neurons", "heads"):
            for b in BASELINES:
                entry[f"{kind}/{b}"] = scores(records, kind, b)
        has = [set(r["neurons"]["zero"]["predicted"]) for r in records]
        counts = {m: sum(m in h for h in has) for m in set.union(*has)}
        partial = [c for c in counts.values() if c < len(records)]
        if partial:  # methods added to some records only: every method on the records the widest of them covers
            need = {m for m, c in counts.items() if c >= max(partial)}
            full = [r for r, h in zip(records, has, strict=True) if need <= h]
            entry["with_every_method"] = {"prompts": len(full)} | {
                f"{kind}/{b}": scores(full, kind, b) for kind in ("neurons", "heads") for b in BASELINES}
        summary[model] = entry
    Path(str(SUMMARY).format(tag=tag(args))).write_text(json.dumps(summary, indent=1) + "\n")
    print(tables(summary))
    plot(summary, Path(str(PLOT).format(tag=tag(args))))
    return summary


NAMES = {"detjac_total": "detjac total", "detjac_direct": "detjac direct", "atp": "AtP", "ig": "IG",
         "detjac_path": "detjac along the path", "ig_layer": "IG, one layer at a time",
         "detjac_path_layer": "detjac along the one-layer path",
         "random": "random", "true": "true top-k"}


def tables(summary: dict[str, Any]) -> str:
    """Markdown tables: per model and unit kind, every method over all prompts (a method added to some only says on
    how many), then every method over the prompts that have them all, where those are fewer."""
    lines = []
    for model in SHIPPED:
        if model not in summary:
            continue
        for kind in ("neurons", "heads"):
            lines += _table(f"{model}, {kind} ({summary[model]['prompts']} prompts)", summary[model], kind)
        subset = summary[model].get("with_every_method")
        if subset:
            for kind in ("neurons", "heads"):
                title = f"{model}, {kind}, every method on the same {subset['prompts']} prompts"
                lines += _table(title + " (fewer where a row says so)", subset, kind)
    return "\n".join(lines)


def _table(title: str, entry: dict[str, Any], kind: str) -> list[str]:
    lines = ["", title, "", "| method | baseline | Pearson | Spearman | P@10 | P@50 | deletion area (norm.) | "
             "Pearson, log-prob |", "|---|---|---|---|---|---|---|---|"]
    for b in BASELINES:
        scored = entry[f"{kind}/{b}"]
        for m, row in sorted(scored["methods"].items(), key=lambda item: METHODS.index(item[0])):
            lo = row["logit"]
            area = row.get("deletion_area_normalized")
            name = NAMES[m] + (f" ({row['prompts']} prompts)" if row["prompts"] < scored["prompts"] else "")
            lines.append(f"| {name} | {b} | {lo['pearson']:.2f} | {lo['spearman']:.2f} | "
                         f"{lo['precision_at_10']:.2f} | {lo['precision_at_50']:.2f} | "
                         f"{'' if area is None else f'{area:.2f}'} | {row['logprob']['pearson']:.2f} |")
    return lines


def plot(summary: dict[str, Any], path: Path) -> None:
    """The deletion curves, one panel per model, unit kind and baseline (matplotlib, installed with the project)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in SHIPPED if m in summary]
    if not models:
        return
    fig, axes = plt.subplots(len(models), 4, figsize=(16, 3.6 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        for col, (kind, b) in enumerate([(k, b) for k in ("neurons", "heads") for b in BASELINES]):
            ax, s = axes[row][col], summary[model][f"{kind}/{b}"]
            for m, data in [*s["methods"].items(), ("true", s["true"])]:
                if "deletion_drop" in data and data.get("prompts", s["prompts"]) == s["prompts"]:  # on every prompt
                    ax.plot(s["ks"], data["deletion_drop"], marker="o", ms=3, label=NAMES[m],
                            ls="--" if m in ("true", "random") else "-")
            ax.set_xscale("log")
            ax.set_title(f"{model}, {kind}, {b} ablation ({s['prompts']} prompts)", fontsize=9)
            ax.set_xlabel("k units ablated together")
            if col == 0:
                ax.set_ylabel("drop of the demeaned logit")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHIPPED))
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    parser.add_argument("--prompts", type=int, default=100, help="prompts to run (with --add: the first records)")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, help="neurons of each method ablated alone")
    parser.add_argument("--random", type=int, default=DEFAULT_RANDOM, help="random active neurons ablated alone")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--summary", action="store_true", help="score the records, write the summary and the plot")
    parser.add_argument("--add", nargs="+", default=None, metavar="METHOD",
                        help=f"add these path methods ({', '.join(PATH_METHODS)}) to the first --prompts records "
                             f"already written, and stop")
    args = parser.parse_args(argv)
    check_names(args.models, SHIPPED, "models")
    check_names(args.methods, METHODS, "methods")
    if args.summary:
        write_summary(args)
        return
    if args.add is not None:
        check_names(args.add, PATH_METHODS, "methods to add")
        add_to_records(args)
        return
    run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
