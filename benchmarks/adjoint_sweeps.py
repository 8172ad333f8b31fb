"""Explicit sweeps against the autograd sweeps and the reference approach, in one run.

One model: a random Llama (d_model 512, 4 layers, ffn 1376, 8 query / 4 key-value heads of 64,
vocabulary 1000, weights perturbed by 0.02), float32 on CPU, one thread by default (the machine
this was written on has 2 cores shared with other jobs; with one thread an op never waits for a
descheduled second one). Three ways to the whole Jacobian of the final normed state at the last
position w.r.t. the input embeddings:

reference
    ``torch.autograd.functional.jacobian(vectorize=True)`` of the linearized (detached) model.
autograd
    ``StreamedModel(sweeps="autograd")``: row blocks of 64 through ``torch.func.vjp`` of one layer at
    a time, vmapped over the block (the sweeps before the explicit ones).
explicit
    ``StreamedModel(sweeps="explicit")``: the same row blocks through each layer's frozen pieces as
    plain matmuls (:mod:`detjac.engine.adjoint`).

Time (32 and 128 tokens by default): the three run interleaved in one process, ``--repeats`` times,
each time from the trace (the reference from its forward pass) to the last row; reported are the
medians, the median of the per-repeat ratios to the reference, and the median fraction of
``torch.matmul``'s rate (a 2048² product measured just before each run: on a shared machine the
rate itself moves by 2x) that the sweeps reach on the FLOP model of ``streamed.sweep_flops``.
Memory (1,024 tokens by default): one fresh process per method, its peak RSS reset after the
model is built and a short prompt warmed up, then the trace and one row block of 64; reported:
peak RSS above that base, and the block's time. Never a timed assertion: a report
(``benchmarks/results/adjoint_sweeps.json``).

    .venv/bin/python benchmarks/adjoint_sweeps.py
    .venv/bin/python benchmarks/adjoint_sweeps.py --quick   # a smaller model and prompts, to check the script
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

from matrix_free import MODEL, QUICK  # the same random Llama as the matrix-free benchmark
from streamed import matmul_flops, peak_mib, reset_peak, sweep_flops

RESULTS = Path(__file__).parent / "results" / "adjoint_sweeps.json"
ROW_BLOCK = 64
METHODS = ("reference", "autograd", "explicit")


def _setup(cfg: dict[str, Any], n: int, threads: int) -> tuple[Any, list[int]]:
    import torch

    from detjac.engine.tiny import tiny_model

    torch.set_num_threads(threads)
    model = tiny_model("llama", dtype=torch.float32, scale=0.02, max_position_embeddings=max(n, 64), **cfg)
    ids = torch.randint(3, cfg["vocab_size"], (n,), generator=torch.Generator().manual_seed(0)).tolist()
    return model, ids


def _reference(model: Any, ids: list[int]) -> Any:
    import torch

    from detjac.engine import linearized

    with linearized(model) as lin:
        x = lin.decoder.get_input_embeddings()(torch.tensor([ids]))[0].detach()
        return torch.autograd.functional.jacobian(
            lambda e: lin.decoder(inputs_embeds=e[None], use_cache=False).last_hidden_state[0, -1], x,
            vectorize=True)


def _streamed(sm: Any, ids: list[int], blocks: int | None = None) -> Any:
    """The output's Jacobian (d, n, d) by row blocks of ROW_BLOCK; with ``blocks``, only that many, not kept."""
    import torch

    from detjac.targets import OUTPUTS

    trace = sm.trace(ids)
    plan = sm.plan(trace, [OUTPUTS], mode="reverse", row_block=ROW_BLOCK)
    jac = None if blocks else torch.empty(sm.d_model, len(ids), sm.d_model, dtype=sm.dtype)
    for k, b in enumerate(sm.blocks(trace, [OUTPUTS], plan)):
        if jac is not None:
            jac[b.start:b.stop] = b.values
        if blocks and k + 1 == blocks:
            break
    return jac


def _flops(cfg: dict[str, Any], n: int) -> float:
    """The FLOP model of pulling d rows back through every layer, the top one from the last position only."""
    d, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    whole = sweep_flops(cfg, n, d, 1)
    return whole * layers - (whole - sweep_flops(cfg, n, d, 1, queries=1))


def child_time(cfg: dict[str, Any], n: int, repeats: int, threads: int) -> dict[str, Any]:
    import torch

    from detjac.engine import StreamedModel

    model, ids = _setup(cfg, n, threads)
    engines = {m: StreamedModel(model, dtype=torch.float32, sweeps=m) for m in ("autograd", "explicit")}
    run = {"reference": lambda: _reference(model, ids),
           **{m: (lambda e=e: _streamed(e, ids)) for m, e in engines.items()}}
    _reference(model, ids[:4])  # warm up kernels and the allocator
    for e in engines.values():
        _streamed(e, ids[:4])
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    rates: dict[str, list[float]] = {m: [] for m in METHODS}  # torch.matmul's rate just before each run
    jacs = {}
    for _ in range(repeats):
        for m in METHODS:
            rates[m].append(matmul_flops(torch.float32))
            t0 = time.perf_counter()
            jacs[m] = run[m]()
            times[m].append(time.perf_counter() - t0)
    flops = _flops(cfg, n)
    out: dict[str, Any] = {"tokens": n, "threads": threads, "repeats": repeats, "seconds": times,
                           "matmul_gflops": {m: [r / 1e9 for r in v] for m, v in rates.items()},
                           "sweep_gflop": flops / 1e9}
    for m in ("autograd", "explicit"):
        out[f"{m}_time_ratio"] = statistics.median(t / r for t, r in zip(times[m], times["reference"], strict=True))
        out[f"{m}_matmul_fraction"] = statistics.median(
            flops / t / rate for t, rate in zip(times[m], rates[m], strict=True))
        out[f"{m}_max_abs_diff"] = float((jacs[m] - jacs["reference"]).abs().max())
    out["explicit_vs_autograd"] = statistics.median(
        e / a for e, a in zip(times["explicit"], times["autograd"], strict=True))
    out["max_abs"] = float(jacs["reference"].abs().max())
    return out


def child_memory(cfg: dict[str, Any], n: int, method: str, threads: int) -> dict[str, Any]:
    import torch

    from detjac.engine import StreamedModel

    model, ids = _setup(cfg, n, threads)
    sm = StreamedModel(model, dtype=torch.float32, sweeps=method)
    _streamed(sm, ids[:8], blocks=1)  # warm up
    base = reset_peak()
    t0 = time.perf_counter()
    _streamed(sm, ids, blocks=1)
    return {"method": method, "tokens": n, "row_block": ROW_BLOCK, "seconds_one_block": time.perf_counter() - t0,
            "peak_above_base_mib": peak_mib() - base}


def _child(*args: str) -> dict[str, Any]:
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}  # as the detjac command sets it
    proc = subprocess.run([sys.executable, __file__, "_child", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        kind, spec = sys.argv[2], json.loads(sys.argv[3])
        fn = child_time if kind == "time" else child_memory
        print(json.dumps(fn(**spec)))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[32, 128], help="prompt lengths timed")
    p.add_argument("--memory-tokens", type=int, default=1024, help="prompt length of the memory comparison")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a smaller model and prompts (checks the script)")
    p.add_argument("--out", type=Path, default=None, help=f"default: {RESULTS} (--quick: not written)")
    args = p.parse_args()
    cfg = QUICK if args.quick else MODEL
    tokens, mem_tokens = ([8, 16], 64) if args.quick else (args.tokens, args.memory_tokens)
    rows = []
    for n in tokens:
        r = _child("time", json.dumps({"cfg": cfg, "n": n, "repeats": args.repeats, "threads": args.threads}))
        rows.append(r)
        med = {m: statistics.median(r["seconds"][m]) for m in METHODS}
        print(f"{n:5d} tokens  reference {med['reference']:7.2f} s   autograd {med['autograd']:7.2f} s "
              f"({r['autograd_time_ratio']:.2f}x, {r['autograd_matmul_fraction']:.2f} of matmul)   "
              f"explicit {med['explicit']:7.2f} s ({r['explicit_time_ratio']:.2f}x, "
              f"{r['explicit_matmul_fraction']:.2f} of matmul)   explicit/autograd {r['explicit_vs_autograd']:.2f}   "
              f"max|dJ| {max(r['autograd_max_abs_diff'], r['explicit_max_abs_diff']):.1e} of {r['max_abs']:.1f}",
              flush=True)
    memory = {m: _child("memory", json.dumps({"cfg": cfg, "n": mem_tokens, "method": m, "threads": args.threads}))
              for m in ("autograd", "explicit")}
    a, e = memory["autograd"], memory["explicit"]
    print(f"{mem_tokens:5d} tokens, one row block of {ROW_BLOCK}: autograd peak +{a['peak_above_base_mib']:.0f} MiB "
          f"({a['seconds_one_block']:.1f} s), explicit +{e['peak_above_base_mib']:.0f} MiB "
          f"({e['seconds_one_block']:.1f} s): ratio {e['peak_above_base_mib'] / a['peak_above_base_mib']:.2f}")
    out = args.out or (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"model": cfg, "timing": rows, "memory": memory}, indent=1))


if __name__ == "__main__":
    main()
