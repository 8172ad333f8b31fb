"""Explicit sweeps against the autograd sweeps and the reference approach, in one run.

One model (``--model small``): a random Llama (d_model 512, 4 layers, ffn 1376, 8 query / 4 key-value
heads of 64, vocabulary 1000, weights perturbed by 0.02); ``--model issue``: the 150M Llama shape of
``streamed.py``'s comparison (d_model 1024, 8 layers, ffn 2816, 16 / 4 heads of 64); float32 on CPU,
one thread by default (the machine this was written on has 2 cores shared with other jobs; with one
thread an op never waits for a descheduled second one). Three ways to the whole Jacobian of the final
normed state at the last position w.r.t. the input embeddings:

reference
    ``torch.autograd.functional.jacobian(vectorize=True)`` of the linearized (detached) model.
autograd
    ``StreamedEngine(sweeps="autograd")``: row blocks of 64 through ``torch.func.vjp`` of one layer at
    a time, vmapped over the block (the sweeps before the explicit ones).
explicit
    ``StreamedEngine(sweeps="explicit")``: the same row blocks through each layer's frozen pieces as
    plain matmuls (:mod:`detjac.engine.streamed.adjoint`).

Time (32 and 128 tokens by default): the three run interleaved in one process, ``--repeats`` times,
each time from the trace (the reference from its forward pass) to the last row; reported are the
medians, the median of the per-repeat ratios to the reference, and two fractions of ``torch.matmul``'s
rate that the sweeps reach on the FLOP model of ``benchmarks.support.flops.sweep_flops``, each measured just before
or
just after the run it is paired with (on a shared machine the rate itself moves by 2x):

square
    against one 2048² product (``benchmarks.support.flops.matmul_flops``);
shapes
    against ``torch.matmul`` on exactly the GEMMs the method ran: every matrix product of one whole
    run is recorded once (``benchmarks.support.gemm_share.record_gemms``) and replayed alone on random operands of
    the
    same layouts after each timed run. ``square = shape factor x shapes``, the shape factor being the
    rate on those shapes over the square product's: the gap splits into "GEMM shape" and the rest
    (element-wise work, copies, Python), whose share of the time is ``1 - gemm_share``.

Memory (1,024 tokens by default): one fresh process per method, its peak RSS reset after the
model is built and a short prompt warmed up, then the trace and one row block of 64; reported:
peak RSS above that base, and the block's time. ``--memory-model``: the same for a few (tokens,
row block) points per sweeps kind, against the cost model's prediction (``CostModel.block_bytes``).
``--profile``: ``torch.profiler`` on row blocks of the explicit and autograd sweeps, the ops' own
CPU time by kind (GEMM, copies, element-wise). Never a timed assertion: a report
(``benchmarks/results/adjoint_sweeps.json``).

    .venv/bin/python -m benchmarks.adjoint_sweeps --repeats 3
    .venv/bin/python -m benchmarks.adjoint_sweeps --model issue --tokens 32 --repeats 1 --no-memory
    .venv/bin/python -m benchmarks.adjoint_sweeps --memory-model --profile --no-timing --no-memory
    .venv/bin/python -m benchmarks.adjoint_sweeps --quick   # a smaller model and prompts, to check the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from detjac.machine import peak_mib, reset_peak

from .support.flops import matmul_flops, sweep_flops
from .support.gemm_share import gemm_flops, record_gemms, replay_seconds, shape_table

# The same random Llamas as benchmarks/matrix_free.py (MODEL, QUICK) and benchmarks/streamed.py (SMALL, "the issue's").
MODEL = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=1000)
QUICK = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=1000)
ISSUE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, vocab_size=4096)
RESULTS = Path(__file__).parent / "results" / "adjoint_sweeps.json"
ROW_BLOCK = 64
METHODS = ("reference", "autograd", "explicit")
SWEEPS = ("autograd", "explicit")
MODELS = {"small": MODEL, "issue": ISSUE}
MEMORY_POINTS = {"explicit": ["128:64", "512:16", "512:64", "1024:16", "1024:64"],
                 "autograd": ["128:64", "512:16", "512:64"]}


def _setup(cfg: dict[str, Any], n: int, threads: int) -> tuple[Any, list[int]]:
    import torch

    from detjac.engine.checkpoints.tiny import tiny_model

    torch.set_num_threads(threads)
    model = tiny_model("llama", dtype=torch.float32, scale=0.02, max_position_embeddings=max(n, 64), **cfg)
    ids = torch.randint(3, cfg["vocab_size"], (n,), generator=torch.Generator().manual_seed(0)).tolist()
    return model, ids


def _reference(model: Any, ids: list[int]) -> Any:
    import torch

    from detjac.engine.detach.model import linearized

    with linearized(model) as lin:
        x = lin.decoder.get_input_embeddings()(torch.tensor([ids]))[0].detach()
        return torch.autograd.functional.jacobian(
            lambda e: lin.decoder(inputs_embeds=e[None], use_cache=False).last_hidden_state[0, -1], x,
            vectorize=True)


def _streamed(sm: Any, ids: list[int], blocks: int | None = None, row_block: int = ROW_BLOCK) -> Any:
    """The output's Jacobian (d, n, d) by row blocks of ``row_block``; with ``blocks``, only that many, not kept."""
    import torch

    from detjac.targets import OUTPUTS

    trace = sm.trace(ids)
    plan = sm.plan(trace, [OUTPUTS], mode="reverse", row_block=row_block)
    jac = None if blocks else torch.empty(sm.d_model, len(ids), sm.d_model, dtype=sm.dtype)
    for k, b in enumerate(sm.blocks(trace, [OUTPUTS], plan)):
        if jac is not None:
            jac[b.start:b.stop] = b.values
        if blocks and k + 1 == blocks:
            break
    return jac


def _flops(cfg: dict[str, Any], n: int, rows: int | None = None) -> float:
    """The FLOP model of pulling ``rows`` (default d) rows back through every layer, the top one from the last
    position only."""
    d, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    rows = d if rows is None else rows
    whole = sweep_flops(cfg, n, rows, 1)
    return whole * layers - (whole - sweep_flops(cfg, n, rows, 1, queries=1))


def _fractions(m: str, flops: float, times: list[float], square: list[float], shapes: list[float] | None
               ) -> dict[str, float]:
    """The FLOP model's rate over torch.matmul's: on a square product, on the run's own GEMM shapes, and the split."""
    med = statistics.median
    out = {f"{m}_matmul_fraction": med(flops / t / r for t, r in zip(times, square, strict=True))}
    if shapes:
        out[f"{m}_matmul_fraction_shapes"] = med(flops / t / r for t, r in zip(times, shapes, strict=True))
        out[f"{m}_shape_factor"] = med(r / q for r, q in zip(shapes, square, strict=True))
    return out


def child_time(cfg: dict[str, Any], n: int, repeats: int, threads: int) -> dict[str, Any]:
    import torch

    from detjac.engine import StreamedEngine

    model, ids = _setup(cfg, n, threads)
    engines = {m: StreamedEngine(model, dtype=torch.float32, sweeps=m) for m in ("autograd", "explicit")}
    run = {"reference": lambda: _reference(model, ids),
           **{m: (lambda e=e: _streamed(e, ids)) for m, e in engines.items()}}
    _reference(model, ids[:4])  # warm up kernels and the allocator
    for e in engines.values():
        _streamed(e, ids[:4])
    gemms = {m: record_gemms(run[m]) for m in SWEEPS}  # every matrix product of one whole run, replayed below
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    rates: dict[str, list[float]] = {m: [] for m in METHODS}  # torch.matmul's rate (square) just before each run
    shape_rates: dict[str, list[float]] = {m: [] for m in SWEEPS}  # ... on the run's own GEMMs, just after it
    replays: dict[str, list[float]] = {m: [] for m in SWEEPS}
    jacs = {}
    for _ in range(repeats):
        for m in METHODS:
            rates[m].append(matmul_flops(torch.float32))
            t0 = time.perf_counter()
            jacs[m] = run[m]()
            times[m].append(time.perf_counter() - t0)
            if m in gemms:
                replays[m].append(replay_seconds(gemms[m]))
                shape_rates[m].append(gemm_flops(gemms[m]) / replays[m][-1])
    flops = _flops(cfg, n)
    out: dict[str, Any] = {"tokens": n, "threads": threads, "repeats": repeats, "seconds": times,
                           "matmul_gflops": {m: [r / 1e9 for r in v] for m, v in rates.items()},
                           "shape_gflops": {m: [r / 1e9 for r in v] for m, v in shape_rates.items()},
                           "gemm_replay_seconds": replays, "sweep_gflop": flops / 1e9,
                           "gemm_gflop": {m: gemm_flops(g) / 1e9 for m, g in gemms.items()},
                           "explicit_gemm_shapes": shape_table(gemms["explicit"])[:8],
                           "load_average": os.getloadavg()}
    for m in SWEEPS:
        out[f"{m}_gemm_share"] = statistics.median(r / t for r, t in zip(replays[m], times[m], strict=True))
    for m in SWEEPS:
        out[f"{m}_time_ratio"] = statistics.median(t / r for t, r in zip(times[m], times["reference"], strict=True))
        out.update(_fractions(m, flops, times[m], rates[m], shape_rates[m]))
        out[f"{m}_max_abs_diff"] = float((jacs[m] - jacs["reference"]).abs().max())
    out["explicit_vs_autograd"] = statistics.median(
        e / a for e, a in zip(times["explicit"], times["autograd"], strict=True))
    out["max_abs"] = float(jacs["reference"].abs().max())
    return out


def child_memory(cfg: dict[str, Any], n: int, method: str, threads: int, rows: int = ROW_BLOCK) -> dict[str, Any]:
    """Peak RSS of the trace and one row block of ``rows`` above the warmed-up model, and the cost model's figure."""
    import torch

    from detjac.engine import StreamedEngine

    model, ids = _setup(cfg, n, threads)
    sm = StreamedEngine(model, dtype=torch.float32, sweeps=method)
    _streamed(sm, ids[:8], blocks=1, row_block=rows)  # warm up
    base = reset_peak()
    t0 = time.perf_counter()
    _streamed(sm, ids, blocks=1, row_block=rows)
    seconds = time.perf_counter() - t0
    old = sm.cost.trace_bytes(n) + rows * 4 * n * (8 * sm.d_model + 4 * sm.ffn)  # the model before it knew kinds
    return {"method": method, "tokens": n, "row_block": rows, "seconds_one_block": seconds,
            "peak_above_base_mib": peak_mib() - base, "predicted_mib": sm.cost.block_bytes(n, rows) / 2**20,
            "previous_model_mib": old / 2**20, "explicit_layers": sm.stats.explicit_layers}


def child_profile(cfg: dict[str, Any], n: int, method: str, threads: int, blocks: int) -> dict[str, Any]:
    """``torch.profiler`` on ``blocks`` row blocks (after one warm-up): the ops' own CPU time by kind."""
    import torch

    from detjac.engine import StreamedEngine

    from .support.gemm_share import profile_kinds

    model, ids = _setup(cfg, n, threads)
    sm = StreamedEngine(model, dtype=torch.float32, sweeps=method)
    _streamed(sm, ids, blocks=1)
    return {"method": method, "tokens": n, "blocks": blocks, "row_block": ROW_BLOCK,
            **profile_kinds(lambda: _streamed(sm, ids, blocks=blocks))}


def _child(*args: str) -> dict[str, Any]:
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}  # as the detjac command sets it
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "_child", *args], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _timing(cfg: dict[str, Any], tokens: list[int], repeats: int, threads: int) -> list[dict[str, Any]]:
    rows = []
    for n in tokens:
        load = os.getloadavg()[0]
        r = _child("time", json.dumps({"cfg": cfg, "n": n, "repeats": repeats, "threads": threads}))
        rows.append(r)
        med = {m: statistics.median(r["seconds"][m]) for m in METHODS}
        print(f"{n:5d} tokens (load {load:.1f} -> {r['load_average'][0]:.1f})  reference {med['reference']:7.2f} s"
              f"   max|dJ| {max(r['autograd_max_abs_diff'], r['explicit_max_abs_diff']):.1e} of {r['max_abs']:.1f}")
        for m in SWEEPS:
            print(f"      {m:9s} {med[m]:7.2f} s  {r[f'{m}_time_ratio']:.2f}x reference   of matmul: "
                  f"{r[f'{m}_matmul_fraction']:.2f} (square) = {r[f'{m}_shape_factor']:.2f} (GEMM shapes) x "
                  f"{r[f'{m}_matmul_fraction_shapes']:.2f} (on its own shapes); GEMMs alone "
                  f"{r[f'{m}_gemm_share']:.2f} of its time", flush=True)
        print(f"      explicit/autograd {r['explicit_vs_autograd']:.2f}", flush=True)
    return rows


def _memory(cfg: dict[str, Any], n: int, threads: int) -> dict[str, Any]:
    memory = {m: _child("memory", json.dumps({"cfg": cfg, "n": n, "method": m, "threads": threads})) for m in SWEEPS}
    a, e = memory["autograd"], memory["explicit"]
    print(f"{n:5d} tokens, one row block of {ROW_BLOCK}: autograd peak +{a['peak_above_base_mib']:.0f} MiB "
          f"({a['seconds_one_block']:.1f} s), explicit +{e['peak_above_base_mib']:.0f} MiB "
          f"({e['seconds_one_block']:.1f} s): ratio {e['peak_above_base_mib'] / a['peak_above_base_mib']:.2f}",
          flush=True)
    return memory


def _memory_model(cfg: dict[str, Any], points: dict[str, list[str]], threads: int) -> list[dict[str, Any]]:
    out = []
    for method, specs in points.items():
        for spec in specs:
            n, rows = (int(x) for x in spec.split(":"))
            r = _child("memory", json.dumps({"cfg": cfg, "n": n, "method": method, "threads": threads, "rows": rows}))
            out.append(r)
            print(f"memory model {method:9s} {n:5d} tokens, block {rows:3d}: measured +{r['peak_above_base_mib']:6.0f}"
                  f" MiB, predicted {r['predicted_mib']:6.0f} MiB ({r['predicted_mib'] / r['peak_above_base_mib']:.2f}"
                  f"x), the previous model {r['previous_model_mib']:6.0f} MiB", flush=True)
    return out


def _profile(cfg: dict[str, Any], n: int, blocks: int, threads: int) -> list[dict[str, Any]]:
    out = []
    for method in SWEEPS:
        r = _child("profile", json.dumps({"cfg": cfg, "n": n, "method": method, "threads": threads, "blocks": blocks}))
        out.append(r)
        kinds = r["self_seconds_by_kind"]
        total = sum(kinds.values())
        print(f"profile {method:9s} {n} tokens, {blocks} blocks of {ROW_BLOCK}: {r['wall_seconds']:.2f} s wall; "
              "ops' own time " + ", ".join(f"{k} {v:.3f} s ({v / total:.0%})" for k, v in sorted(kinds.items())),
              flush=True)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        kind, spec = sys.argv[2], json.loads(sys.argv[3])
        fn = {"time": child_time, "memory": child_memory, "profile": child_profile}[kind]
        print(json.dumps(fn(**spec)))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="small", help="small: d 512, 4 layers; issue: d 1024, 8")
    p.add_argument("--tokens", type=int, nargs="+", default=[32, 128], help="prompt lengths timed")
    p.add_argument("--memory-tokens", type=int, default=1024, help="prompt length of the memory comparison")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-timing", action="store_true", help="skip the timed comparison")
    p.add_argument("--no-memory", action="store_true", help="skip the memory comparison")
    p.add_argument("--memory-model", action="store_true", help="the cost model's memory against measured peaks")
    p.add_argument("--profile", type=int, nargs="?", const=128, default=None, metavar="TOKENS",
                   help="profile 2 row blocks of each sweeps kind at TOKENS (default 128)")
    p.add_argument("--quick", action="store_true", help="a smaller model and prompts (checks the script)")
    p.add_argument("--out", type=Path, default=None, help=f"default: {RESULTS} (--quick: not written)")
    args = p.parse_args()
    cfg = QUICK if args.quick else MODELS[args.model]
    tokens, mem_tokens = ([8, 16], 64) if args.quick else (args.tokens, args.memory_tokens)
    points = {m: ["16:8", "64:32"] for m in SWEEPS} if args.quick else MEMORY_POINTS
    result: dict[str, Any] = {"model": cfg, "command": " ".join(sys.argv[1:]), "threads": args.threads}
    if not args.no_timing:
        result["timing"] = _timing(cfg, tokens, args.repeats, args.threads)
    if not args.no_memory:
        result["memory"] = _memory(cfg, mem_tokens, args.threads)
    if args.memory_model:
        result["memory_model"] = _memory_model(cfg, points, args.threads)
    if args.profile is not None:
        result["profile"] = _profile(cfg, 16 if args.quick else args.profile, 2, args.threads)
    out = args.out or (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
