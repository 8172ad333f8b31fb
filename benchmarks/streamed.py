"""The layer-streamed engine against the reference approach, and out of core.

Every measurement runs in a fresh process (peak RSS is the process's high-water mark);
ratios compare runs made one after the other by this script on the same machine.
Never a timed assertion: this is a report (JSON under ``benchmarks/results/``).

Sections
--------
compare
    Random-weight models that fit in RAM, float32, CPU. The reference approach is
    ``torch.autograd.functional.jacobian(vectorize=True)`` of the detached model's final
    hidden state at the last position w.r.t. the input embeddings (the whole Jacobian in
    one call). detjac streams one layer at a time with row blocks going to a zarr store
    as they come. Reported: time ratio (detjac / reference), peak RSS above the loaded
    weights and its ratio, max |difference| of the two Jacobians, and efficiency: the
    achieved FLOP/s of detjac's row sweeps divided by ``torch.matmul``'s FLOP/s measured
    in the same process (FLOP model: :func:`benchmarks.support.flops.sweep_flops`). The reference runs with 4 KiB
    pages
    and with huge pages (``THP_MEM_ALLOC_ENABLE``; the faster is the baseline). detjac runs twice:
    as ``detjac run --streamed`` does (huge pages, row blocks of 64), and under a CPU
    ``--max-memory`` of two layers plus ``BUDGET_SHARE`` of the reference's peak above the
    weights (the engine sizes the row block; the store's shards are sized as the CLI sizes
    them; freed blocks go back to the system at once). Peaks are measured from a reset
    (``clear_refs``) after the model is built and warmed up.
layerwise
    The cumulative Jacobian of every layer's output: the reference's per-layer loop (one
    ``jacobian(vectorize=True)`` call per layer) against one detjac request.
ooc
    Out of core: a random-weight model written as sharded bf16 safetensors, weights at
    least 4x the CPU budget, computed in float32 under ``--max-memory cpu=...``: peak RSS
    against the budget, and time per layer per row block.
gpu
    On a CUDA machine only: a 70B-shaped run (the Llama-3-70B config with a few of its 80
    layers, random weights, nf4 round trip) with peak GPU memory and time per layer,
    extrapolated to 80 layers; and a 14B-shaped (Qwen3-14B config) bf16 run under an
    8 GiB GPU budget.

    .venv/bin/python -m benchmarks.streamed compare layerwise ooc
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from detjac.machine import peak_mib, reset_peak

RESULTS = Path(__file__).parent / "results" / "streamed.json"
BUDGET_SHARE = 0.1  # the budgeted run's --max-memory: two layers plus this share of the reference's peak above weights

# Random Llama, d=1024, 8 layers, ffn 2816, GQA 16/4 heads (the figures quoted in the issue).
SMALL = dict(model_type="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=4096)
# Qwen3-0.6B's shape (28 layers, d=1024, ffn 3072, 16/8 heads of 128), vocabulary cut to 32k.
HALF_B = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
              num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000)
# Qwen3-4B's shape with 40 layers (4.4B parameters, 8.9 GB in bf16).
OOC = dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=40,
           num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
           tie_word_embeddings=True)


def _model(cfg: dict[str, Any], n: int) -> Any:
    from detjac.engine.checkpoints.tiny import tiny_model

    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    return tiny_model(cfg["model_type"], dtype=_torch().float32, scale=0.02, max_position_embeddings=max(n, 64), **kw)


def _torch() -> Any:
    import torch

    return torch


# -- children -------------------------------------------------------------------------------


def child_reference(cfg: dict[str, Any], n: int, out: str, layers: list[int] | None) -> dict[str, Any]:
    torch = _torch()
    from detjac.engine.detach.model import linearized

    model = _model(cfg, n)
    ids = torch.randint(3, cfg["vocab_size"], (n,), generator=torch.Generator().manual_seed(0)).tolist()
    with linearized(model) as lin:
        x = lin.decoder.get_input_embeddings()(torch.tensor([ids]))[0].detach()
        decoder = lin.decoder

        def final(e: Any) -> Any:
            return decoder(inputs_embeds=e[None], use_cache=False).last_hidden_state[0, -1]

        torch.autograd.functional.jacobian(final, x[:2], vectorize=True)  # warm up
        base = reset_peak()
        t0 = time.perf_counter()
        if layers is None:
            jac = torch.autograd.functional.jacobian(final, x, vectorize=True)
            torch.save(jac, out)
        else:
            for layer in layers:  # hidden_states[l + 1] is layer l's output (the last one is normed: not used)
                def upto(e: Any, layer: int = layer) -> Any:
                    hs = decoder(inputs_embeds=e[None], use_cache=False, output_hidden_states=True).hidden_states
                    return hs[layer + 1][0, -1]

                jac = torch.autograd.functional.jacobian(upto, x, vectorize=True)
                if layer == _checked(layers):
                    torch.save(jac, out)
                del jac
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rss_above_weights_mib": peak_mib() - base}


def child_detjac(cfg: dict[str, Any], n: int, out: str, layers: list[int] | None, row_block: int,
                 extra_budget_mib: float | None) -> dict[str, Any]:
    """detjac as ``detjac run --streamed`` runs it; with ``extra_budget_mib``, under ``--max-memory cpu=`` two
    layers (what the budget sets aside for streamed weights; here they are resident, not copied) plus that many MiB,
    the row block chosen by the plan and the store's shards sized as the CLI sizes them under a budget."""
    torch = _torch()
    from detjac.engine import StreamedEngine, honour_cpu_budget, prompt_pass
    from detjac.engine.cost import depth
    from detjac.runs.batch import budget_shard_bytes
    from detjac.store import create_store
    from detjac.targets import Target

    from .support.flops import matmul_flops, sweep_flops

    model = _model(cfg, n)
    ids = torch.randint(3, cfg["vocab_size"], (n,), generator=torch.Generator().manual_seed(0)).tolist()
    flops_matmul = matmul_flops(torch.float32)
    sm = StreamedEngine(model, dtype=torch.float32)
    budget = None
    if extra_budget_mib is not None:
        budget = 2 * sm.skeleton.layer_bytes() + int(extra_budget_mib * 2**20)
        sm = StreamedEngine(model, dtype=torch.float32, max_memory={"cpu": budget})
        honour_cpu_budget(sm.device, {"cpu": budget})  # as the detjac command does
        row_block = None
    prompt_pass(sm, ids[:2], row_block=row_block)  # warm up
    shutil.rmtree(Path(out).with_suffix(".zarr"), ignore_errors=True)  # a fresh store per run
    store = create_store(Path(out).with_suffix(".zarr"), {"model_id": "bench"})
    base = reset_peak()
    t0 = time.perf_counter()
    trace = sm.trace(ids)
    targets = [Target(-1, "output")] if layers is None else [Target(i, "layer") for i in layers]
    plan = sm.plan(trace, targets, row_block=row_block, mode="reverse" if layers is None else "auto")
    t_sweeps = time.perf_counter()
    d = sm.d_model
    writers = {t: store.begin(f"{i:016x}", n_rows=d, n_tokens=n, n_cols=d, dtype="float32", row_block=plan.row_block,
                              shard_bytes=budget_shard_bytes(sm))
               for i, t in enumerate(targets)}
    checked = targets[0] if layers is None else Target(_checked(layers), "layer")
    for b in sm.blocks(trace, targets, plan):  # row blocks go to the store as they come
        writers[b.target].write_block("jacobian", b.start, b.stop, b.token_start, b.token_stop, b.values.numpy())
    seconds = time.perf_counter() - t0
    sweeps = time.perf_counter() - t_sweeps
    rss_above = peak_mib() - base  # before reading anything back
    w = writers[checked]
    w.write_array("embeddings", trace.embeddings.numpy())
    w.write_array("output", trace.value(checked).numpy())
    w.write_array("token_ids", np.asarray(ids, dtype=np.int64))
    w.commit({})
    for t, other in writers.items():
        if t != checked:
            other.abort()
    stored = store.get(f"{targets.index(checked):016x}").jacobian(lazy=False)
    store.close()
    torch.save(torch.from_numpy(stored), out)
    if plan.forward:  # tokens k0:k1 carry (k1 - k0) d tangents over positions k0: through every layer
        flops = sum(sweep_flops(cfg, n - k0, min(plan.token_block, n - k0) * d, 1)
                    for k0 in range(0, n, plan.token_block)) * max(depth(t, sm.n_layers) for t in targets)
    else:
        flops = sweep_flops(cfg, n, d, 1) * sum(depth(t, sm.n_layers) for t in targets)
        if sm.stats.pulled_suffix_layers:  # the top layer's targets were pulled back from the target position only
            start = [sm.n_layers - 1 if t.component == "output" else t.layer for t in targets]
            saved = sweep_flops(cfg, n, d, 1) - sweep_flops(cfg, n, d, 1, queries=n - trace.position)
            flops -= start.count(max(start)) * saved
    return {"seconds": seconds, "rss_above_weights_mib": rss_above, "row_block": plan.row_block,
            "budget_mib": None if budget is None else budget / 2**20,
            "huge_pages": os.environ.get("THP_MEM_ALLOC_ENABLE", "0"),
            "token_block": plan.token_block, "mode": "forward" if plan.forward else "reverse",
            "matmul_gflops": flops_matmul / 1e9, "sweep_gflops": flops / sweeps / 1e9,
            "suffix_layers": sm.stats.suffix_layers, "pulled_suffix_layers": sm.stats.pulled_suffix_layers,
            "auto_mode": "forward" if sm.plan(trace, targets).forward else "reverse"}


def _checked(layers: list[int]) -> int:
    """The layer whose Jacobian both sides save for comparison (not the last: the reference's is normed)."""
    return layers[len(layers) // 2]


def child_ooc(folder: str, n: int, budget: str, blocks: int) -> dict[str, Any]:
    torch = _torch()
    from detjac.engine import StreamedEngine, honour_cpu_budget
    from detjac.targets import Target

    sm = StreamedEngine(folder, dtype=torch.float32, max_memory=budget)
    honour_cpu_budget(sm.device, budget)  # as the detjac command does
    ids = list(range(100, 100 + n))
    base = peak_mib()
    t0 = time.perf_counter()
    trace = sm.trace(ids, progress=True)
    forward_s = time.perf_counter() - t0
    plan = sm.plan(trace, [Target(-1, "output")])
    per_block, t1, done = [], time.perf_counter(), 0
    for b in sm.blocks(trace, [Target(-1, "output")], plan, progress=True):
        per_block.append(time.perf_counter() - t1)
        t1 = time.perf_counter()
        done += 1
        assert b.values.shape[0] == b.stop - b.start
        if done == blocks:
            break
    return {"forward_pass_s": forward_s, "row_block": plan.row_block, "row_blocks_total": plan.n_row_blocks,
            "seconds_per_row_block": per_block, "seconds_per_layer_per_row_block": [s / sm.n_layers for s in per_block],
            "peak_rss_mib": peak_mib(), "rss_after_start_mib": base,
            "layer_mib_float32": sm.skeleton.layer_bytes() / 2**20, "gib_read": sm.stats.bytes_read / 2**30}


def _run_child(*args: str, huge_pages: bool = True) -> dict[str, Any]:
    """One measurement in a fresh process; ``huge_pages``: THP_MEM_ALLOC_ENABLE as the CLI sets it (PyTorch reads
    it at its first allocation)."""
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1" if huge_pages else "0"}
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "_child", *args], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- sections -------------------------------------------------------------------------------


def _pair(
    name: str, cfg: dict[str, Any], n: int, tmp: Path, layers: list[int] | None, row_block: int,
    pages: tuple[str, ...] = ("4k", "thp"), budgeted: bool = True,
) -> dict[str, Any]:
    """The reference with and without huge pages (``pages``; the faster is the baseline), then detjac as the CLI
    runs it (huge pages on), then (``budgeted``) detjac under a CPU budget of two layers plus BUDGET_SHARE of the
    reference's memory."""
    torch = _torch()
    spec = json.dumps({"cfg": cfg, "n": n, "layers": layers, "row_block": row_block})
    refs = {p: _run_child("reference", spec, str(tmp / f"ref_{p}.pt"), huge_pages=p == "thp") for p in pages}
    ref = min(refs.values(), key=lambda r: r["seconds"])
    shutil.copy(tmp / f"ref_{pages[0]}.pt", tmp / "ref.pt")
    ours = _run_child("detjac", spec, str(tmp / "ours.pt"))
    ref_rss = max(min(r["rss_above_weights_mib"] for r in refs.values()), 1e-9)
    row = {"name": name, "tokens": n, "reference": ref, **{f"reference_{p}_pages": r for p, r in refs.items()},
           "detjac": ours, "time_ratio": ours["seconds"] / ref["seconds"],
           "rss_ratio": ours["rss_above_weights_mib"] / ref_rss,
           "efficiency_vs_matmul": ours["sweep_gflops"] / ours["matmul_gflops"]}
    a = torch.load(tmp / "ref.pt")
    diffs = [(a - torch.load(tmp / "ours.pt")).abs().max()]
    if budgeted:
        extra = BUDGET_SHARE * ref_rss
        low = _run_child("detjac", json.dumps({**json.loads(spec), "extra_budget_mib": extra}), str(tmp / "low.pt"))
        diffs.append((a - torch.load(tmp / "low.pt")).abs().max())
        row.update({"detjac_budget": low, "time_ratio_budget": low["seconds"] / ref["seconds"],
                    "rss_ratio_budget": low["rss_above_weights_mib"] / ref_rss,
                    "efficiency_vs_matmul_budget": low["sweep_gflops"] / low["matmul_gflops"]})
    row.update({"max_abs_diff": float(max(diffs)), "max_abs": float(a.abs().max())})
    print(json.dumps(row), flush=True)
    return row


def section_compare(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    runs = [("llama d1024 L8", SMALL, 32), ("llama d1024 L8", SMALL, 128), ("qwen3-0.6B shape", HALF_B, 32)]
    return [_pair(name, cfg, n, tmp, None, 64) for name, cfg, n in (runs[:1] if quick else runs)]


def section_layerwise(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    """All layer outputs: reverse mode's regime (8 layers, 32 tokens) and forward mode's (28 layers, 4 tokens)."""
    rows = [_pair("llama d1024 L8, all layer outputs", SMALL, 8 if quick else 32, tmp,
                  list(range(SMALL["num_hidden_layers"])), 64, pages=("thp",), budgeted=False)]
    if not quick:
        rows.append(_pair("qwen3-0.6B shape, all 28 layer outputs", HALF_B, 4, tmp,
                          list(range(HALF_B["num_hidden_layers"])), 64, pages=("thp",), budgeted=False))
    return rows


def section_ooc(tmp: Path, quick: bool) -> dict[str, Any]:
    from .support.random_weights import write_random_checkpoint

    torch = _torch()
    cfg = {**OOC, "num_hidden_layers": 4} if quick else OOC
    folder = tmp / "ooc-model"
    t0 = time.perf_counter()
    on_disk = write_random_checkpoint(folder, cfg, torch.bfloat16)
    budget_gib = 2.0
    res = _run_child("ooc", str(folder), "16", f"cpu={budget_gib}GiB", "1")
    res.update({"config": cfg, "tokens": 16, "budget_gib": budget_gib, "weights_on_disk_gib": on_disk / 2**30,
                "weights_over_budget": on_disk / 2**30 / budget_gib, "write_s": time.perf_counter() - t0})
    print(json.dumps(res), flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        kind = sys.argv[2]
        if kind == "ooc":
            result = child_ooc(sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
        else:
            spec = json.loads(sys.argv[3])
            _torch().set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
            if kind == "reference":
                result = child_reference(spec["cfg"], spec["n"], sys.argv[4], spec["layers"])
            else:
                result = child_detjac(spec["cfg"], spec["n"], sys.argv[4], spec["layers"], spec["row_block"],
                                      spec.get("extra_budget_mib"))
        print(json.dumps(result))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sections", nargs="+", choices=["compare", "layerwise", "ooc", "gpu"])
    p.add_argument("--quick", action="store_true", help="smallest sizes only (checks that the script runs)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for section in args.sections:
            if section == "gpu":  # CUDA machines only: benchmarks/gpu_streamed.py, in its own process
                out = Path(tmp) / "gpu_streamed.json"
                subprocess.run([sys.executable, "-m", f"{__package__}.gpu_streamed", "--out", str(out)],
                               check=True)
                results["gpu"] = json.loads(out.read_text())
            else:
                results[section] = {"compare": section_compare, "layerwise": section_layerwise,
                                    "ooc": section_ooc}[section](Path(tmp), args.quick)
            results.setdefault("machine", {"threads": 2, "python": sys.version.split()[0]})
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
