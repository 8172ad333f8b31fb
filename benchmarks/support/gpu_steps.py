"""The steps of the GPU check (:mod:`benchmarks.gpu_check`), each run in the worker process: what it measures is
put into its :class:`~benchmarks.support.gpu_run.Partial` as it goes, so a step cut short keeps what it did."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .gpu_graph import step_graph_heads
from .gpu_run import (
    EXACT,
    FAMILIES,
    LAYERS_70B,
    Meter,
    Partial,
    checkpoint,
    device_budget,
    dry_budget,
    random_ids,
    say,
    sizes,
)


def step_machine(args: argparse.Namespace, out: Partial) -> None:
    import platform

    import torch
    import transformers

    from .flops import matmul_flops

    s = sizes(args.dry_run)
    info: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "cuda": torch.version.cuda,
                            "transformers": transformers.__version__, "python": platform.python_version(),
                            "cpu_count": os.cpu_count(), "dry_run": args.dry_run}
    if torch.device(args.device).type == "cuda":
        props = torch.cuda.get_device_properties(args.device)
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30,
                    capability=f"{props.major}.{props.minor}", cudnn=torch.backends.cudnn.version())
        smi = shutil.which("nvidia-smi")
        if smi:
            got = subprocess.run([smi, "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True)
            info["nvidia_smi"] = got.stdout.strip()
    out.put(**info)
    say(f"machine: {json.dumps(info)}")
    size = s["matmul"]
    rates = {}
    for name, dtype, tf32 in (("bfloat16", torch.bfloat16, False), ("float32", torch.float32, False),
                              ("float32_tf32", torch.float32, True), ("float64", torch.float64, False)):
        rates[name] = matmul_flops(dtype, args.device, size, tf32=tf32) / 1e12
        out.put(matmul_tflops={**rates}, matmul_size=size)
        say(f"matmul {size}^3 {name}: {rates[name]:.1f} TFLOP/s")



def step_exactness(args: argparse.Namespace, out: Partial) -> None:
    import torch

    from detjac.engine import InMemoryEngine, jacobian, load_model
    from detjac.engine.checkpoints.tiny import tiny_model

    s = sizes(args.dry_run)
    cases: dict[str, Callable[[], Any]] = {"default": lambda: load_model("default", dtype=torch.float64)}
    for family in FAMILIES:
        cases[family] = lambda family=family: tiny_model(family, dtype=torch.float64)
    rows: dict[str, Any] = {}
    for name, make in cases.items():
        model = make()
        vocab = model.config.get_text_config().vocab_size
        ids = random_ids(vocab, s["exact_tokens"])
        ref = jacobian(InMemoryEngine(model), ids).jacobian
        scale = float(ref.abs().max())
        row: dict[str, Any] = {"tokens": len(ids)}
        for label, dtype, tf32 in (("float64", torch.float64, False), ("float32", torch.float32, False),
                                   ("float32_tf32", torch.float32, True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            on = model.to(device=args.device, dtype=dtype)
            res = jacobian(InMemoryEngine(on), ids, check=dtype == torch.float64)
            diff = float((res.jacobian.to("cpu", torch.float64) - ref).abs().max()) / scale
            row[label] = {"rel_error_vs_cpu_float64": diff, "reconstruction_error": float(res.reconstruction_error)}
            model = on.to(device="cpu", dtype=torch.float64)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        row["exact"] = row["float64"]["rel_error_vs_cpu_float64"] <= EXACT
        rows[name] = row
        out.put(models=rows, all_exact=all(r["exact"] for r in rows.values()))
        errors = {label: row[label]["rel_error_vs_cpu_float64"] for label in ("float64", "float32", "float32_tf32")}
        say(f"exactness {name}: float64 {errors['float64']:.1e}, float32 {errors['float32']:.1e}, TF32 "
            f"{errors['float32_tf32']:.1e}")
        del model



def step_streamed(args: argparse.Namespace, out: Partial, which: str, tokens: int, dtype_name: str) -> None:
    """The output's J at ``tokens`` tokens on the ``which`` shape, layer-streamed under the budget."""
    import torch

    from detjac.engine import StreamedEngine
    from detjac.engine.result import reconstruct
    from detjac.errors import InvalidArgumentError
    from detjac.exactness import relative_error
    from detjac.targets import Target

    from .flops import matmul_flops, sweep_flops

    s = sizes(args.dry_run)
    cfg, dtype = s[which], getattr(torch, dtype_name)
    folder = checkpoint(args, which)
    meter = Meter(args.device)
    meter.reset()
    target = Target(-1, "output")
    refused: list[dict[str, str]] = []
    ladder = s["budgets"] if s["budgets"] else ["1MiB", dry_budget(folder, dtype, tokens)]
    for amount in ladder:  # the smallest budget the engine takes for this shape, dtype and length
        budget = device_budget(args.device, amount)
        t0 = meter.now()
        try:
            engine = StreamedEngine(folder, dtype=dtype, device=args.device, max_memory=budget)
            engine.cost.plan(tokens, [target], mode="reverse")
            break
        except InvalidArgumentError as err:
            refused.append({"max_memory": budget, "refused": str(err)})
            say(f"{which} {tokens} tokens {dtype_name}: {budget} refused: {err}")
    else:
        out.put(refused=refused)
        raise SystemExit(f"no budget of {ladder} holds the {which} shape at {tokens} tokens in {dtype_name}")
    init_s = meter.now() - t0
    out.put(refused_budgets=refused)
    L, d = engine.n_layers, engine.d_model
    spans: list[dict[int, float]] = []  # per row block: each layer's seconds from loaded to released
    opened: dict[int, float] = {}
    load, release = engine.skeleton.load_layer, engine.skeleton.release_layer

    def timed_load(i: int) -> None:
        load(i)
        opened[i] = meter.now()

    def timed_release(i: int) -> None:
        t = meter.now()
        release(i)
        if i in opened and spans:  # the forward pass's loads come before the first block: not counted
            spans[-1][i] = t - opened.pop(i)

    engine.skeleton.load_layer, engine.skeleton.release_layer = timed_load, timed_release  # type: ignore[method-assign]
    ids = random_ids(cfg["vocab_size"], tokens)
    t0 = meter.now()
    trace = engine.trace(ids)
    forward_s = meter.now() - t0
    plan = engine.plan(trace, [target], mode="reverse")
    rows_block = plan.row_block
    out.put(shape=which, layers=L, d_model=d, tokens=tokens, dtype=dtype_name, max_memory=budget, init_s=init_s,
            forward_s=forward_s, row_block=rows_block, row_blocks=plan.n_row_blocks,
            layer_gib=engine.skeleton.layer_bytes() / 2**30,
            stored_layer_gib=engine.skeleton.stored_layer_bytes() / 2**30)
    say(f"{which} {tokens} tokens {dtype_name}: forward {forward_s:.2f} s; {plan.n_row_blocks} row blocks of "
        f"{rows_block}")
    jac = torch.empty(d, tokens, d, dtype=dtype)
    per_block: list[float] = []
    stats = engine.stats
    loaded0, kept0, read0 = stats.layers_loaded, stats.layers_kept, stats.bytes_read
    t_start = t_block = meter.now()
    spans.append({})
    for k, b in enumerate(engine.blocks(trace, [target], plan), 1):
        jac[b.start:b.stop] = b.values.to("cpu")
        del b
        meter.sample()
        t = meter.now()
        per_block.append(t - t_block)
        t_block = t
        out.put(blocks_done=k, seconds_per_block=per_block, middle_layer_seconds=_middle(spans, L),
                layer_seconds=[[block.get(i) for i in range(L)] for block in spans], **meter.peaks())
        say(f"{which} {tokens} {dtype_name}: row block {k}/{plan.n_row_blocks} {per_block[-1]:.2f} s")
        spans.append({})
    jacobian_s = meter.now() - t_start
    peaks = meter.peaks()  # before the matmul below allocates its own operands
    # the rate of the sweep's widest GEMM shape, (rows × n, d) @ (d, ffn), in this process (rows capped: memory)
    gemm = (min(rows_block * tokens, 16384), cfg["hidden_size"], cfg["intermediate_size"])
    rate = matmul_flops(dtype, args.device, shape=gemm) / 1e12
    loads = stats.layers_loaded - loaded0
    moved = (stats.layers_loaded - stats.layers_kept) * engine.skeleton.stored_layer_bytes()  # as stored; forward too
    flops = sweep_flops(cfg, tokens, d, L - 1) + sweep_flops(cfg, tokens, d, 1, queries=1)
    emb = trace.embeddings.to("cpu", torch.float64)
    recon = relative_error(reconstruct(jac.double(), emb), trace.output.to("cpu", torch.float64))
    row: dict[str, Any] = {
        "jacobian_s": jacobian_s, "seconds_per_prompt": forward_s + jacobian_s,
        "seconds_per_layer_per_row_block": jacobian_s / L / plan.n_row_blocks,
        "matmul_gemm": list(gemm), "matmul_tflops_same_shape": rate,
        "sweep_tflops": flops / jacobian_s / 1e12, "share_of_matmul": flops / jacobian_s / 1e12 / rate,
        "folded": engine.cost.folds(rows_block), "layer_loads": loads, "layers_kept": stats.layers_kept - kept0,
        "gib_read": (stats.bytes_read - read0) / 2**30,
        "gib_host_to_device": moved / 2**30 if meter.cuda else 0.0, "weight_wait_s": stats.weight_wait_seconds,
        "reconstruction_error": recon, "finite": bool(torch.isfinite(jac).all()), **peaks,
    }
    if which in ("70b", "q4"):  # 80 layers: the middle layers' time scales with the depth; the top one is pulled once
        per_middle = _middle(spans, L)
        row["extrapolated_80_layers"] = {
            "jacobian_s": jacobian_s + (LAYERS_70B - L) * per_middle * plan.n_row_blocks,
            "forward_s": forward_s * LAYERS_70B / L,
            "note": f"the middle layers' median seconds per row block times the {LAYERS_70B - L} more layers and the "
                    "row blocks; "
                    "peak memory is one layer plus the blocks' vectors and the (2L+2) n d trace, which grows",
        }
    out.put(**row)
    say(f"{which} {tokens} {dtype_name}: J {jacobian_s:.1f} s, {row['sweep_tflops']:.1f} TFLOP/s "
        f"({row['share_of_matmul']:.2f} of matmul {gemm} at {rate:.1f}), reconstruction {recon:.1e}, peaks {peaks}")
    if which == "8b" and tokens == s["short"] and dtype_name == "float32":
        torch.save({"ids": ids, "jacobian": jac}, Path(args.tmp) / f"j8b{'-dry' if args.dry_run else ''}.pt")


def _middle(spans: list[dict[int, float]], n_layers: int) -> float:
    """The median seconds a layer below the top one takes in one row block (the top layer is pulled back from the
    target position only, and is cheaper)."""
    below = [t for block in spans for i, t in block.items() if i < n_layers - 1]
    return statistics.median(below) if below else float("nan")


def step_svd(args: argparse.Namespace, out: Partial) -> None:
    import torch

    from detjac.engine import StreamedEngine
    from detjac.engine.products.lanczos import operator_svd
    from detjac.engine.products.linear_operator import StreamedOperator

    s = sizes(args.dry_run)
    folder = checkpoint(args, "8b")
    meter = Meter(args.device)
    meter.reset()
    budget = device_budget(args.device, s["svd_budget"])
    engine = StreamedEngine(folder, dtype=torch.float32, device=args.device, max_memory=budget)
    ids = random_ids(s["8b"]["vocab_size"], s["svd_tokens"])
    t0 = meter.now()
    op = StreamedOperator(engine, ids)
    build_s = meter.now() - t0
    out.put(tokens=len(ids), dtype="float32", max_memory=budget, build_s=build_s)
    say(f"svd: forward pass {build_s:.1f} s at {len(ids)} tokens")
    svd = operator_svd(op, 16, block=8, orient=op.produced)
    seconds = meter.now() - t0
    out.put(seconds=seconds, products=svd.products, matvecs=svd.matvecs, rmatvecs=svd.rmatvecs,
            iterations=svd.iterations, converged=svd.converged, max_residual=float(svd.residuals.max()),
            sigma=[float(x) for x in svd.S], sweeps=op.stats.sweeps, layer_loads=engine.stats.layers_loaded,
            layers_kept=engine.stats.layers_kept, **meter.peaks())
    say(f"svd: top 16 in {seconds:.1f} s, {svd.products} products, converged {svd.converged}")


def step_cli(args: argparse.Namespace, out: Partial) -> None:
    import torch

    s = sizes(args.dry_run)
    folder = checkpoint(args, "8b")
    work = Path(args.tmp) / "cli"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    prompt = work / "prompt.txt"
    prompt.write_text("The bridge out of Marin is the one that the fog rolls over every morning\n")
    detjac = shutil.which("detjac") or str(Path(sys.executable).parent / "detjac")
    budget = s["budget"] or dry_budget(folder, torch.float32, 32)  # the prompt has fewer than 32 tokens
    cmd = [detjac, "run", str(folder), str(prompt), "--out", str(work / "run.zarr"), "--dtype", "float32",
           "--device", args.device, "--max-memory", device_budget(args.device, budget)]
    say("cli: " + " ".join(cmd))
    t0 = time.perf_counter()
    got = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in (work / "run.zarr").rglob("*") if f.is_file())
    out.put(command=" ".join(cmd[1:]), returncode=got.returncode, seconds=seconds, store_gib=size / 2**30,
            output_tail=(got.stdout + got.stderr)[-2000:])
    say(f"cli: exit {got.returncode} in {seconds:.1f} s, store {size / 2**30:.2f} GiB")
    if got.returncode != 0:
        raise SystemExit(f"detjac run failed with exit {got.returncode}")


def step_reference(args: argparse.Namespace, out: Partial) -> None:
    import torch

    from detjac.engine import load_model
    from detjac.engine.detach.model import linearized

    s = sizes(args.dry_run)
    folder = checkpoint(args, "8b")
    meter = Meter(args.device)
    t0 = meter.now()
    model = load_model(str(folder), dtype=torch.float32, device=args.device)
    out.put(load_s=meter.now() - t0, dtype="float32")
    runs: list[dict[str, Any]] = []
    saved = Path(args.tmp) / f"j8b{'-dry' if args.dry_run else ''}.pt"
    ours = torch.load(saved) if saved.is_file() else None  # the 8b-16-f32 step's ids and J
    for n in s["reference_lengths"]:
        compared = ours is not None and n == s["short"]
        ids = ours["ids"] if compared else random_ids(s["8b"]["vocab_size"], n)
        meter.reset()
        row: dict[str, Any] = {"tokens": n}
        try:
            with linearized(model) as lin:
                x = lin.decoder.get_input_embeddings()(torch.tensor([ids], device=args.device))[0]
                t1 = meter.now()
                jac = torch.autograd.functional.jacobian(
                    lambda e: lin.decoder(inputs_embeds=e[None], use_cache=False).last_hidden_state[0, -1],
                    x, vectorize=True)
                row.update(seconds=meter.now() - t1, **meter.peaks())
            if compared:
                theirs, mine = jac.cpu().double(), ours["jacobian"].double()
                row["rel_diff_vs_detjac"] = float((theirs - mine).abs().max() / mine.abs().max())
            del jac
        except torch.cuda.OutOfMemoryError as err:
            row.update(out_of_memory=True, error=str(err).splitlines()[0][:300], **meter.peaks())
        runs.append(row)
        out.put(runs=runs)
        say(f"reference {n} tokens: {row}")
        if row.get("out_of_memory"):
            break
        if meter.cuda:
            torch.cuda.empty_cache()


def run_step(name: str, args: argparse.Namespace, out: Partial) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if name == "machine":
        return step_machine(args, out)
    if name == "exactness":
        return step_exactness(args, out)
    if name == "svd-1024":
        return step_svd(args, out)
    if name == "cli":
        return step_cli(args, out)
    if name == "reference":
        return step_reference(args, out)
    if name == "graph-heads":
        return step_graph_heads(args, out)
    if name.startswith("checkpoint-"):
        t0 = time.perf_counter()
        path = checkpoint(args, name.removeprefix("checkpoint-"))
        files = [path] if path.is_file() else [f for f in path.iterdir() if f.is_file()]
        size = sum(f.stat().st_size for f in files)
        return out.put(path=str(path), gib=size / 2**30, seconds=time.perf_counter() - t0)
    which, length, dt = name.split("-")
    s = sizes(args.dry_run)
    return step_streamed(args, out, which, s["short"] if length == "16" else s["long"],
                         {"f32": "float32", "f64": "float64", "bf16": "bfloat16"}[dt])
