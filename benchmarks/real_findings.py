"""The paper's findings measured on two real trained models: SmolLM2-135M-Instruct and Gemma 3 270M (GGUF).

Prompts: ``benchmarks/data/factbook_prompts.jsonl`` (sentences of the CIA World Factbook, public domain, each
without its last word; the rule is in ``scripts/factbook_prompts.py``); a model keeps the ``eval`` prompts of 8 to
64 tokens in its own tokenizer. Parts (``--part``), each resumable: what is already in the results is kept and
skipped, every prompt's record is written as soon as it is computed (``--limit`` stops after that many new ones).

records (float64, in memory)
    Per prompt: the detached J (``detached_jacobian``, exactly what ``detjac jacobian`` computes), its
    reconstruction error; the ordinary Jacobian's reconstruction error ``||J_ord x - y|| / ||y||`` from one JVP of
    the model in the direction of its own embeddings x (``J_ord`` is never formed); the predicted next token;
    the 10 tokens decoded from ``u_1`` of ``[J_1 ... J_n]`` (signs fixed by ``u . y >= 0``), of the ordinary
    Jacobian's ``u_1`` (block Lanczos on products with ``J_ord`` and ``J_ord^T``, ``operator_svd``), and of a
    random unit vector (seeded by the prompt's index); stable rank and energy ranks (90 / 99 %) of J.
layerwise (float32, layer-streamed, the first ``--layer-prompts`` records)
    Every layer's ``layer_normed`` target (the paper's convention: the final norm applied to that layer's output)
    and the output: stable rank, energy ranks, the 10 tokens decoded from ``u_1``; a concept "emerges" at the
    first layer whose ``u_1`` holds the model's prediction among its 10 tokens.
example (float64)
    The paper's prompt "The bridge out of Marin is the" decoded in full: the top 3 triplets of the combined
    operator and of every ``J_k``, 10 tokens each.
steering (float32)
    ``detjac steer`` with ``--method paper`` and detjac's own, a grid of strengths and three layers, over unrelated
    evaluation prompts: the share of greedy continuations that contain a concept word, against the unsteered one.
lens
    The same-position lens (``detjac run --lens``, float32) and the ``jlens`` estimator (float64), each with
    detached and ordinary Jacobians, fitted on ``lens`` prompts and scored by ``detjac lens evaluate`` against the
    logit lens on the first ``--lens-eval`` records' prompts: its summary rows, and every prompt's rank of its
    prediction per method and layer (``--lens-table`` also splits off the frequent predictions with them).

Results: ``benchmarks/results/real_models.json`` (per model: ``prompts``, ``layerwise``, ``example``, ``steering``,
``lens``, ``summary``, ``timing``); ``--summary`` recomputes the summary and prints it. Every record names the CPU
that computed it (``host``; the summary's ``by_host`` groups them): times and the last bits of float64 results
depend on it. Progress goes to stdout, one line per prompt. The two models can run in two processes at once
(each save merges only its own model's entry into the file); a second process on a model already running is
refused.

    .venv/bin/python -m benchmarks.real_findings --model smollm2 --part records          # ~35 s a prompt
    .venv/bin/python -m benchmarks.real_findings --model gemma3 --part layerwise --layer-prompts 40
    .venv/bin/python -m benchmarks.real_findings --summary --plot docs/real-models-layers.png
    .venv/bin/python -m benchmarks.real_findings --example-table     # the tables of docs/real-models.md
    .venv/bin/python -m benchmarks.real_findings --lens-table        # the tables of docs/lens.md
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from detjac.machine import host

from .support.findings import (
    example_markdown,
    findings_summary,
    lens_comparison_markdown,
    lens_evaluation_ranks,
)
from .support.shared_json import holding, load_entries, save_entry
from .support.shipped import SHIPPED, shipped_gguf

HERE = Path(__file__).parent
PROMPTS = HERE / "data" / "factbook_prompts.jsonl"
RESULTS = HERE / "results" / "real_models.json"
MIN_TOKENS, MAX_TOKENS, TOP = 8, 64, 10
EXAMPLE = "The bridge out of Marin is the"


# -- results file -----------------------------------------------------------------------------


def load_results() -> dict[str, Any]:
    return load_entries(RESULTS)


def save_results(results: dict[str, Any], name: str, key: str | None = None) -> None:
    """Model ``name``'s entry (or only its ``key``) merged into the file as it is on disk now
    (``benchmarks.support.shared_json``): a process running another model at the same time keeps what it wrote,
    and a kill leaves the previous file."""
    save_entry(RESULTS, results, name, key)


def model_results(results: dict[str, Any], name: str) -> dict[str, Any]:
    entry = results.setdefault(name, {})
    for key, empty in (("prompts", []), ("skipped", []), ("layerwise", []), ("timing", {})):
        entry.setdefault(key, empty)
    return entry


def add_time(entry: dict[str, Any], part: str, seconds: float, count: int) -> None:
    t = entry["timing"].setdefault(part, {"seconds": 0.0, "count": 0})
    t["seconds"] += seconds
    t["count"] += count
    t["machine"] = host()


def eval_prompts() -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["split"] == "eval"]


# -- measurements -----------------------------------------------------------------------------


def spectrum_figures(S: Any) -> dict[str, Any]:
    from detjac.analysis.spectra import dimensionality

    dim = dimensionality(S.double().cpu().numpy())
    return {"sigma1": float(S[0]), "stable_rank": dim.stable_rank, "n90": dim.n90, "n99": dim.n99}


def top_tokens(u: Any, W_U: Any) -> list[int]:
    from detjac.engine import decode_top

    return decode_top(u.reshape(-1, 1).to(W_U.dtype), W_U, TOP)[0][0].tolist()


def ordinary_figures(model: Any, ids: list[int], x: Any, y: Any, W_U: Any) -> dict[str, Any]:
    """The ordinary Jacobian, matrix-free: its reconstruction (one JVP along x) and its decoded u_1."""
    import torch

    from detjac.engine import jacobian_operator, operator_svd
    from detjac.exactness import relative_error

    op = jacobian_operator(model, ids, detach=False)
    recon = relative_error(op.matvec(x.reshape(-1).to(op.dtype)), y)
    svd = operator_svd(op, 1, orient=y.to(op.dtype), tol=1e-6)  # residual 1e-6 of sigma_1: ample to rank tokens
    with torch.no_grad():
        return {"recon_ordinary": recon, "ordinary_u1_top10": top_tokens(svd.U[:, 0], W_U),
                "ordinary_sigma1": float(svd.S[0]), "ordinary_products": svd.matvecs + svd.rmatvecs}


def record(model: Any, W_U: Any, index: int, item: dict[str, Any]) -> dict[str, Any] | str:
    """One prompt's record, or the reason it is skipped (its length in tokens)."""
    import torch

    from detjac.engine import InMemoryEngine, jacobian
    from detjac.engine.products.decode import dense_svd

    t0 = time.perf_counter()
    res = jacobian(InMemoryEngine(model), item["text"], check=False)
    n = len(res.token_ids)
    if not MIN_TOKENS <= n <= MAX_TOKENS:
        return f"{n} tokens"
    seconds_detached = time.perf_counter() - t0
    op = res.combined()
    S = torch.linalg.svdvals(op)
    u1 = dense_svd(op, 1, orient=res.produced).U[:, 0]
    next_id = int(res.logits.reshape(-1, res.logits.shape[-1])[-1].argmax())
    u1_top = top_tokens(u1, W_U)
    gen = torch.Generator().manual_seed(index)
    r = torch.randn(op.shape[0], generator=gen, dtype=op.dtype)
    random_top = top_tokens(r / r.norm(), W_U)
    t1 = time.perf_counter()
    ordinary = ordinary_figures(model, list(res.token_ids), res.embeddings, res.output, W_U)
    return {"index": index, "text": item["text"], "file": item["file"], "token_ids": list(res.token_ids),
            "next_token_id": next_id, "recon_detached": float(res.reconstruction_error), **ordinary,
            "u1_top10": u1_top, "u1_hit": next_id in u1_top,
            "ordinary_u1_hit": next_id in ordinary["ordinary_u1_top10"],
            "random_top10": random_top, "random_hit": next_id in random_top, **spectrum_figures(S),
            "seconds_detached": seconds_detached, "seconds_ordinary": time.perf_counter() - t1, "host": host()}


def run_records(name: str, limit: int | None) -> None:
    import torch

    from detjac.engine import load_model
    from detjac.engine.products.decode import model_decoding_matrices

    results = load_results()
    entry = model_results(results, name)
    done = {r["index"] for r in entry["prompts"]} | {s["index"] for s in entry["skipped"]}
    todo = [(i, p) for i, p in enumerate(eval_prompts()) if i not in done]
    if not todo:
        print(f"{name} records: all {len(done)} prompts done")
        return
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = load_model(shipped_gguf(name), dtype=torch.float64)
    W_U = model_decoding_matrices(model)["unembedding"]
    for count, (index, item) in enumerate(todo[:limit] if limit else todo):
        t0 = time.perf_counter()
        got = record(model, W_U, index, item)
        seconds = time.perf_counter() - t0
        if isinstance(got, str):
            entry["skipped"].append({"index": index, "why": got})
        else:
            entry["prompts"].append(got)
            add_time(entry, "records", seconds, 1)
        save_results(results, name)
        rows = entry["prompts"]
        hits = sum(r["u1_hit"] for r in rows)
        print(f"{name} records {len(rows) + len(entry['skipped'])}/{len(done) + len(todo)} "
              f"[{count + 1} this run] {seconds:6.1f} s "
              + (f"recon {got['recon_detached']:.1e} / ordinary {got['recon_ordinary']:.1e}, u1 hit {got['u1_hit']}"
                 if not isinstance(got, str) else f"skipped ({got})")
              + f"; u1 hit rate so far {hits}/{len(rows)}", flush=True)


def left_spectrum(op: Any, orient: Any) -> tuple[Any, Any]:
    """All singular values of a wide ``op`` (d, n d) and its ``u_1`` (``u_1 . orient >= 0``), from the Gram matrix
    ``op op^T`` in float64 (``gram_left_spectrum``): ten times cheaper than an SVD of the float32 layer Jacobians at
    40 tokens (the figures kept are ratios of squared singular values and the top ``u``)."""
    import torch

    from detjac.analysis.spectra import gram_left_spectrum

    A = op.double()
    S, u1 = gram_left_spectrum((A @ A.T).cpu().numpy(), orient.reshape(-1).double().cpu().numpy())  # torch's BLAS
    return torch.from_numpy(S), torch.from_numpy(u1)


def run_layerwise(name: str, count: int, limit: int | None) -> None:
    import torch

    from detjac.engine import load_engine, prompt_pass
    from detjac.targets import OUTPUTS, Target

    results = load_results()
    entry = model_results(results, name)
    done = {r["index"] for r in entry["layerwise"]}
    chosen = sorted(entry["prompts"], key=lambda r: r["index"])[:count]
    todo = [r for r in chosen if r["index"] not in done]
    if len(chosen) < count:
        print(f"{name} layerwise: only {len(chosen)} records so far (wanted the first {count}); run --part records")
    if not todo:
        print(f"{name} layerwise: the first {len(chosen)} records done")
        return
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    engine = load_engine(shipped_gguf(name), streamed=True, dtype=torch.float32)
    W_U = engine.decoding_matrices(torch.float32)["unembedding"]
    targets = [Target(layer, "layer_normed") for layer in range(engine.n_layers)] + [OUTPUTS]
    for k, rec in enumerate(todo[:limit] if limit else todo):
        t0 = time.perf_counter()
        res = prompt_pass(engine, rec["token_ids"], targets)
        seconds_jacobians = time.perf_counter() - t0
        layers = []
        for t in targets:
            J = res.jacobians[t]
            S, u1 = left_spectrum(J.reshape(J.shape[0], -1), res.trace.value(t))
            top = top_tokens(u1, W_U)
            layers.append({"layer": t.layer if not t.is_output else "output", **spectrum_figures(S),
                           "recon": res.errors[t], "u1_top10": top,
                           "hit": rec["next_token_id"] in top})
        emergence = next((row["layer"] for row in layers if row["hit"]), None)
        seconds = time.perf_counter() - t0
        entry["layerwise"].append({"index": rec["index"], "n_tokens": len(rec["token_ids"]), "layers": layers,
                                   "emergence": emergence, "seconds": seconds,
                                   "seconds_jacobians": seconds_jacobians, "host": host()})
        add_time(entry, "layerwise", seconds, 1)
        save_results(results, name)
        print(f"{name} layerwise {len(entry['layerwise'])}/{len(chosen)} [{k + 1} this run] {seconds:6.1f} s, "
              f"{len(rec['token_ids'])} tokens, emergence at layer {emergence}", flush=True)


def run_example(name: str) -> None:
    import torch

    from detjac.engine import InMemoryEngine, jacobian, load_model
    from detjac.engine.tools.triplets import explain

    results = load_results()
    entry = model_results(results, name)
    model = load_model(shipped_gguf(name), dtype=torch.float64)
    t0 = time.perf_counter()
    res = jacobian(InMemoryEngine(model), EXAMPLE)
    expl = explain(res, model, k=3, top=TOP)

    def decoded(op: Any) -> dict[str, Any]:
        return {"label": op.label, "sigma": op.singular_values.tolist(), "left_ids": op.left_ids.tolist(),
                "right_ids": op.right_ids.tolist(), "right_positions": op.right_positions}

    entry["example"] = {"text": EXAMPLE, "token_ids": list(res.token_ids),
                        "next_token_id": int(res.logits.reshape(-1, res.logits.shape[-1])[-1].argmax()),
                        "recon_detached": float(res.reconstruction_error), "combined": decoded(expl.combined),
                        "per_token": [decoded(op) for op in expl.per_token]}
    add_time(entry, "example", time.perf_counter() - t0, 1)
    save_results(results, name)
    print(f"{name} example: {len(res.token_ids)} tokens, reconstruction {res.reconstruction_error:.1e}")


CONCEPT = "The ocean is deep and cold, and whales, sharks and fish swim in its dark water"
CONCEPT_WORDS = " ocean, sea, whale, whales, shark, fish, water, waves, marine"
STRENGTHS = [0.0, 0.5, 1.0, 2.0, 4.0]


def steering_prompts(tokenizer: Any, count: int) -> list[str]:
    """The first ``count`` evaluation prompts with no concept word (by first token) in them: unrelated prompts."""
    from detjac.runs.steering import concept_ids

    words = concept_ids(tokenizer, CONCEPT, CONCEPT_WORDS)
    chosen = []
    for item in eval_prompts():
        if not words & set(tokenizer(item["text"])["input_ids"]):
            chosen.append(item["text"])
        if len(chosen) == count:
            break
    return chosen


def run_steering(name: str, layers: list[float], count: int, work: Path) -> None:
    """A grid of methods x layers x strengths over ``count`` unrelated prompts: the share of continuations holding
    a concept word, against the unsteered baseline (strength 0)."""
    import subprocess

    from detjac.runs.steering import concept_ids, evaluate_steering, load_concept, prepare_evaluation
    from detjac.store import open_store

    results = load_results()
    entry = model_results(results, name)
    steering = entry.setdefault("steering", {"concept": CONCEPT, "words": CONCEPT_WORDS, "strengths": STRENGTHS,
                                             "grid": []})
    path = shipped_gguf(name)
    if "layers" not in steering:
        from detjac.engine.checkpoints.gguf import gguf_config

        n_layers = gguf_config(path).get_text_config().num_hidden_layers
        steering["layers"] = sorted({min(n_layers - 1, int(f * n_layers)) for f in layers})
    chosen = steering["layers"]
    store = work / f"{name}-concept.zarr"
    concept_file = work / "concept.txt"
    work.mkdir(parents=True, exist_ok=True)
    concept_file.write_text(CONCEPT + "\n")
    if not store.exists() or not len(open_store(store)):
        t0 = time.perf_counter()
        cmd = [_detjac(), "run", str(path), str(concept_file), "--out", str(store),
               "--layers", ",".join(map(str, chosen)), "--components", "layer,layer_normed", "--dtype", "float32"]
        subprocess.run(cmd, check=True)
        add_time(entry, "steering concept run", time.perf_counter() - t0, 1)
    pid = open_store(store).prompt_ids()[0]
    done = {(g["method"], g["layer"]) for g in steering["grid"]}
    prompts_file = work / f"{name}-steering-prompts.txt"
    for method in ("paper", "detjac"):
        for layer in chosen:
            if (method, layer) in done:
                continue
            t0 = time.perf_counter()
            session = load_concept(str(path), store, pid, layer, method=method)
            if "prompts" not in steering:
                steering["prompts"] = steering_prompts(session.tokenizer, count)
                steering["concept_tokens"] = sorted(concept_ids(session.tokenizer, CONCEPT, CONCEPT_WORDS))
            prompts_file.write_text("".join(p + "\n" for p in steering["prompts"]))
            evaluation = prepare_evaluation(session, prompts_file, CONCEPT_WORDS)
            table = evaluate_steering(session, evaluation, STRENGTHS, progress=False)
            steering["grid"].append({"method": method, "layer": layer, "rows": table.rows})
            add_time(entry, "steering", time.perf_counter() - t0, 1)
            save_results(results, name)
            shares = ", ".join(f"{r['strength']:g}: {r['share_with_concept']:.2f}" for r in table.rows)
            print(f"{name} steering {method} layer {layer}: share with a concept word by strength {shares}",
                  flush=True)


def _detjac() -> str:
    import sys

    return str(Path(sys.executable).with_name("detjac"))


def _evaluate_lens(path: Path, lens: Path, ordinary: Path, eval_file: Path, out: Path) -> dict[str, Any]:
    import subprocess

    subprocess.run([_detjac(), "lens", "evaluate", str(lens), "--ordinary", str(ordinary), "--model", str(path),
                    "--prompts", str(eval_file), "--exact", "0", "--out", str(out)], check=True)
    return lens_evaluation_ranks(out)


def _stored_prompts(path: Path) -> int:
    """How many prompts the store at ``path`` holds (0 if there is none yet)."""
    from detjac.store import open_store

    return len(open_store(path).prompt_ids()) if path.exists() else 0


def run_lens(name: str, fit_count: int, eval_count: int, work: Path) -> None:
    """Two estimators, each detached and ordinary, fitted on the first ``fit_count`` ``lens`` prompts and evaluated
    against the logit lens on the first ``eval_count`` records' prompts (disjoint: other sentences) by ``detjac lens
    evaluate``: detjac's same-position lens (``detjac run --lens``, float32) and the ``jlens`` estimator
    (``detjac lens fit --estimator jlens``, float64, texts of 18 tokens or more)."""
    import subprocess

    from detjac.runs import jlens_fitted_on

    results = load_results()
    entry = model_results(results, name)
    done = entry.setdefault("lens", {"fit_prompts": fit_count})
    path = shipped_gguf(name)
    work.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    fit_file, eval_file = work / "lens_fit.txt", work / f"{name}-lens-eval.txt"
    fit_file.write_text("".join(r["text"] + "\n" for r in [r for r in rows if r["split"] == "lens"][:fit_count]))
    records = sorted(entry["prompts"], key=lambda r: r["index"])[:eval_count]
    eval_file.write_text("".join(r["text"] + "\n" for r in records))
    done["eval_prompts"] = len(records)
    for estimator in ("same-position", "jlens"):
        if estimator in done:
            print(f"{name} lens {estimator}: done")
            continue
        lenses = {}
        for kind in ("detached", "ordinary"):
            t0 = time.perf_counter()
            computed = fit_count
            if estimator == "same-position":
                lenses[kind] = work / f"{name}-lens-{kind}.zarr"
                before = _stored_prompts(lenses[kind])
                subprocess.run([_detjac(), "run", str(path), str(fit_file), "--out", str(lenses[kind]), "--lens",
                                "--dtype", "float32", *(["--ordinary"] if kind == "ordinary" else [])], check=True)
                computed = _stored_prompts(lenses[kind]) - before  # a resumed run computes only the rest
            else:
                lenses[kind] = work / f"{name}-{kind}.jlens"
                if jlens_fitted_on(lenses[kind], fit_file):
                    print(f"{name} lens jlens ({kind}): kept the lens fitted by an earlier run", flush=True)
                    continue
                subprocess.run([_detjac(), "lens", "fit", str(lenses[kind]), "--estimator", "jlens", "--model",
                                str(path), "--prompts", str(fit_file), "--force",
                                *(["--ordinary"] if kind == "ordinary" else [])], check=True)
            add_time(entry, f"lens fit {estimator} ({kind})", time.perf_counter() - t0, computed)
        t0 = time.perf_counter()
        got = _evaluate_lens(path, lenses["detached"], lenses["ordinary"], eval_file, work / f"{name}-{estimator}-eval")
        add_time(entry, f"lens evaluate {estimator}", time.perf_counter() - t0, len(records))
        done[estimator] = {"dtype": "float32" if estimator == "same-position" else "float64", **got}
        save_results(results, name)
        print(f"{name} lens {estimator}: {len(got['summary'])} rows of lens_summary.csv kept, and the ranks of "
              f"{len(got['predicted'])} prompts", flush=True)


# -- summary ----------------------------------------------------------------------------------


def plot_layers(results: dict[str, Any], out: Path) -> Path | None:
    """Stable rank, energy rank n90 and the top-10 hit rate of ``u_1`` against relative depth, and where the
    prediction emerges, for every model with layerwise records; None when there are none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [(name, results[name]["summary"]["layerwise"]) for name in SHIPPED
              if "layerwise" in results.get(name, {}).get("summary", {})]
    if not models:
        return None
    fig, axes = plt.subplots(1, 5, figsize=(20, 3.6))
    for name, lw in models:
        rows = [r for r in lw["by_layer"] if r["layer"] != "output"]
        depth = [(r["layer"] + 1) / len(rows) for r in rows]
        label = f"{name} ({lw['prompts']} prompts)"
        axes[0].plot(depth, [r["stable_rank"] for r in rows], marker=".", label=label)
        axes[1].plot(depth, [r["n90"] for r in rows], marker=".", label=label)
        axes[2].plot(depth, [r["hit_rate"] for r in rows], marker=".", label=label)
        for ax, hist, count in ((axes[3], lw["emergence_histogram"], lw["prompts"]),
                                (axes[4], lw.get("uncommon_emergence_histogram", {}), lw.get("uncommon_prompts", 0))):
            layers = [k for k in hist if k not in ("output", "None")]
            ax.bar([(int(k) + 1) / len(rows) for k in layers], [hist[k] / max(1, count) for k in layers],
                   width=0.8 / len(rows), alpha=0.6, label=f"{name} ({count} prompts)")
    titles = ["stable rank of layer_normed J (median)", "energy rank n90 (median)",
              "prediction in u_1's top 10 (share)", "emergence: first such layer (share)",
              "emergence, predictions other than the 5 most frequent"]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xlim(0, 1.05)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("relative depth (layer + 1) / layers")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def print_summary(results: dict[str, Any]) -> None:
    for name in SHIPPED:
        entry = results.get(name)
        if not entry:
            continue
        s = entry["summary"] = findings_summary(entry)
        save_results(results, name, "summary")
        print(f"{name}: {s['prompts']} prompts ({s['skipped']} skipped for length)")
        if s["prompts"]:
            for key in ("recon_detached", "recon_ordinary"):
                q = s[key]
                print(f"  {key:<16} median {q['median']:.1e}  p90 {q['p90']:.1e}  max {q['max']:.1e}")
            for key in ("u1_top10_rate", "ordinary_u1_top10_rate", "random_top10_rate"):
                r = s[key]
                print(f"  {key:<24} {r['hits']}/{r['n']} = {r['rate']:.3f}  95% CI [{r['ci95'][0]:.3f}, "
                      f"{r['ci95'][1]:.3f}]")
            other, rest = s["other_prompts_u1_top10_rate"], s["uncommon_u1_top10_rate"]
            print(f"  control: another prompt's u_1 holds the prediction in {other['rate']:.3f} of pairs; "
                  f"predictions other than the {len(s['frequent_predictions'])} most frequent: {rest['hits']}/"
                  f"{rest['n']} = {rest['rate']:.3f}  95% CI [{rest['ci95'][0]:.3f}, {rest['ci95'][1]:.3f}]")
            t = s["record_seconds"]
            print(f"  a record takes {sum(t.values()):.1f} s: the detached J {t['detached_jacobian']:.1f} s, the "
                  f"ordinary JVP and Lanczos {t['ordinary_jvp_and_lanczos']:.1f} s, the rest {t['rest']:.1f} s")
            for machine, h in s["by_host"].items():
                q = h["recon_detached"]
                print(f"  host {machine}: {h['prompts']} records, recon_detached median {q['median']:.1e} (max "
                      f"{q['max']:.1e}), the detached J {h['seconds_detached']:.1f} s, the "
                      f"ordinary JVP and Lanczos {h['seconds_ordinary']:.1f} s")
            print(f"  stable rank median {s['stable_rank']['median']:.2f}, n90 median {s['n90']['median']:.0f}, "
                  f"n99 median {s['n99']['median']:.0f}")
        if "layerwise" in s:
            lw = s["layerwise"]
            print(f"  layerwise over {lw['prompts']} prompts; emergence {lw['emergence_histogram']}; on the "
                  f"{lw['uncommon_prompts']} whose prediction is not a frequent one "
                  f"{lw['uncommon_emergence_histogram']}")
            if "jacobians_share_of_time" in lw:
                share = lw["jacobians_share_of_time"]
                print(f"  layerwise: the Jacobians take {share['share']:.0%} of the time (over {share['prompts']} "
                      "prompts), the spectra and decoding the rest")
        for part, t in entry["timing"].items():
            # The mean pools every session that added to it; `machine` is only the last one's (see by_host).
            print(f"  time {part}: {t['seconds'] / max(1, t['count']):.1f} s each over {t['count']} "
                  f"(last added on {t['machine']})")


def print_tables(part: str, names: Any) -> None:
    """The markdown tables of docs/real-models.md for ``part`` (``"lens"`` or ``"example"``), per model that has it."""
    results = load_results()
    for name in names:
        if part not in results.get(name, {}):
            print(f"{name}: no {part} in {RESULTS} yet (run --model {name} --part {part})")
            continue
        if part == "lens":
            table = lens_comparison_markdown(results[name]["lens"])
        else:
            from detjac.engine.checkpoints.gguf import gguf_tokenizer

            table = example_markdown(results[name]["example"], gguf_tokenizer(shipped_gguf(name)))
        print(f"{name}:\n\n{table}\n")


def main() -> None:
    global RESULTS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=SHIPPED, action="append", help="default: both")
    p.add_argument("--part", choices=("records", "layerwise", "example", "steering", "lens"), action="append")
    p.add_argument("--limit", type=int, help="stop after this many new prompts per model and part")
    p.add_argument("--layer-prompts", type=int, default=40, help="layerwise: the first this many records")
    p.add_argument("--steering-layers", default="0.25,0.5,0.75", help="steering: layers as fractions of the depth")
    p.add_argument("--steering-prompts", type=int, default=24, help="steering: unrelated prompts")
    p.add_argument("--lens-fit", type=int, default=16, help="lens: fit on the first this many 'lens' prompts")
    p.add_argument("--lens-eval", type=int, default=40, help="lens: evaluate on the first this many records")
    p.add_argument("--work", type=Path, default=Path("/tmp/detjac-real-findings"),
                   help="work folder: steering's concept store, the lens part's stores and lenses")
    p.add_argument("--summary", action="store_true", help="recompute and print the summary, then stop")
    p.add_argument("--lens-table", action="store_true", help="print the lens comparison as markdown")
    p.add_argument("--example-table", action="store_true", help="print the example's decoded operators as markdown")
    p.add_argument("--plot", type=Path, help="with --summary: draw the layerwise figures into this PNG")
    p.add_argument("--results", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    args = p.parse_args()
    RESULTS = args.results
    if args.lens_table or args.example_table:
        print_tables("lens" if args.lens_table else "example", args.model or SHIPPED)
        return
    if args.summary:
        results = load_results()
        print_summary(results)
        if args.plot and plot_layers(results, args.plot):
            print(f"wrote {args.plot}")
        return
    for name in args.model or SHIPPED:
        with ExitStack() as held:
            try:  # one process at a time runs a model's parts: two would each save their own copy of its entry
                held.enter_context(holding(RESULTS, name))
            except BlockingIOError as exc:
                raise SystemExit(str(exc)) from None
            for part in args.part or ("example", "records", "layerwise", "steering", "lens"):
                if part == "records":
                    run_records(name, args.limit)
                elif part == "layerwise":
                    run_layerwise(name, args.layer_prompts, args.limit)
                elif part == "lens":
                    run_lens(name, args.lens_fit, args.lens_eval, args.work)
                elif part == "steering":
                    run_steering(name, [float(f) for f in args.steering_layers.split(",")], args.steering_prompts,
                                 args.work)
                else:
                    run_example(name)
    print_summary(load_results())


if __name__ == "__main__":
    main()
