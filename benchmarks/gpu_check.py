"""The GPU check: every measurement of the GPU issue in one call, prepared to run within minutes on one H100.

A GPU is lent to some work only, for minutes, on a machine with no network: this script is the whole call. It
runs each step in a child process under a deadline (``--budget-s``, 420 s by default), the most valuable steps
first, prints timestamped progress, and rewrites ``DIR/gpu.json`` (and appends ``DIR/gpu.log``) after every step,
so a run cut short still says how far it got; a step that runs out of time keeps what its child wrote so far
(per row block) and is marked ``cut_short``.

Steps, in order (``--only a,b`` runs some; ``--skip`` leaves some out):

machine        the GPU, its memory, driver, torch and CUDA versions; ``torch.matmul`` rates (bf16, float32 with
               TF32 off and on, float64)
exactness      the shipped default model and tiny random configs of six families (llama, qwen3, gemma3, phi3,
               olmo2, qwen3_moe), the in-memory engine: float64 on the device against float64 on the CPU (relative
               to the largest entry; ``exact`` is <= 1e-12), the device's own reconstruction error, and float32
               with TF32 off and on against the same CPU float64 J
checkpoint-8b, checkpoint-70b
               the random bf16 checkpoints of the two shapes below written under ``--tmp`` (a rerun with the same
               ``--tmp`` finds them and skips the write)
8b-16-f32      Llama-3.1-8B's shape (random bf16 weights, all 32 layers, written by the script), the layer-streamed
               engine, the output's J at 16 tokens in float32, under the smallest of 8, 12, 16, 24, 32, 48 and 60 GiB
               (``--max-memory <device>=...``) that the engine takes (those it refuses are kept with its reason):
               seconds, seconds per layer per row block, achieved TFLOP/s against ``torch.matmul`` of the sweep's
               GEMM shape in the same process (the TFLOP/s count the unfolded sweep's FLOPs: where the MLP folds,
               it does fewer), peak GPU memory (the allocator's; the driver's, sampled per row
               block), host RSS, bytes read and copied host to device, the reconstruction error of the J
70b-16-f32     Llama-3.3-70B's shape, 3 of its 80 layers (embeddings tied: the output's J never reads the
               unembedding), the same; each layer's time per row block, extrapolated to 80 layers (one layer in
               float32 is 3.2 GiB and the engine holds two, one in use and one read ahead: 8 GiB is refused)
svd-1024       the matrix-free top-16 SVD (block Lanczos on J and J^T products) at 1,024 tokens on the 8B shape,
               float32, a 60 GiB budget so the layers stay on the device between products
70b-16-f64, 8b-16-f64
               as above in float64
reference      ``torch.autograd.functional.jacobian(vectorize=True)`` on the detached 8B-shaped model held on the
               device in float32 (the paper's method): 16 tokens, then 64, until it runs out of memory; its J
               against detjac's at 16 tokens
70b-16-bf16    the 70B shape in bfloat16 (not exact; the paper's run was float16), where 8 GiB holds it
cli            ``detjac run`` on the 8B shape (the default model's tokenizer copied into the checkpoint), 16-token
               prompt, float32, ``--device`` and ``--max-memory``: the command a user types, store written
8b-64-f32, 8b-64-f64
               the 8B shape at 64 tokens

``--dry-run`` runs exactly these code paths on the CPU at tiny shapes (in ``make test``, under 2 minutes), so the
call cannot rot before a GPU is lent. On the GPU machine (no network; the missing packages travel as wheels,
``make gpu-wheels`` here):

    bash scripts/gpu_install.sh -- python -m benchmarks.gpu_check --out "$OUT"
    .venv/bin/python -m benchmarks.gpu_check --dry-run --out /tmp/gpu-dry

Then ``benchmarks/results/gpu.json`` is ``DIR/gpu.json``, and ``--table DIR/gpu.json`` prints the docs table.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .support.real_shapes import REAL_SHAPES

SCHEMA = 1
BUDGET_S = 420.0
RESERVE_S = 8.0  # left at the end for the last gpu.json
MIN_STEP_S = 20.0  # a step with less time than this left is skipped, not started
EXACT = 1e-12

# Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json) and Llama-3.3-70B (3 of its 80 layers).
LLAMA31_8B: dict[str, Any] = REAL_SHAPES["llama-3.1-8b"]
LLAMA33_70B: dict[str, Any] = {**REAL_SHAPES["llama-3.3-70b"], "num_hidden_layers": 3, "tie_word_embeddings": True}
LAYERS_70B = 80
# --dry-run: the same structure (GQA, several row blocks under the budget) at CPU sizes.
DRY_8B: dict[str, Any] = {**LLAMA31_8B, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 6144,
                          "max_position_embeddings": 256}
DRY_70B: dict[str, Any] = {**LLAMA33_70B, "hidden_size": 96, "intermediate_size": 256, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 6144, "max_position_embeddings": 256}
FAMILIES = ("llama", "qwen3", "gemma3", "phi3", "olmo2", "qwen3_moe")


def sizes(dry: bool) -> dict[str, Any]:
    """Shapes, lengths and budgets of a real run, or of the dry run (same code paths, CPU sizes)."""
    if dry:
        return {"8b": DRY_8B, "70b": DRY_70B, "short": 8, "long": 12, "svd_tokens": 24, "budget": None, "budgets": None,
                "svd_budget": "64MiB", "matmul": 256, "exact_tokens": 6, "reference_lengths": [8, 12]}
    return {"8b": LLAMA31_8B, "70b": LLAMA33_70B, "short": 16, "long": 64, "svd_tokens": 1024, "budget": "8GiB",
            "budgets": ["8GiB", "12GiB", "16GiB", "24GiB", "32GiB", "48GiB", "60GiB"],
            "svd_budget": "60GiB", "matmul": 8192, "exact_tokens": 12, "reference_lengths": [16, 64]}


# The steps in order, each with the longest it may take on an H100 (seconds; ten times that in the dry run).
STEPS: list[tuple[str, float]] = [
    ("machine", 40), ("exactness", 60), ("checkpoint-8b", 120), ("8b-16-f32", 90), ("checkpoint-70b", 60),
    ("70b-16-f32", 90), ("svd-1024", 120),
    ("70b-16-f64", 90), ("8b-16-f64", 100), ("reference", 120), ("70b-16-bf16", 60), ("cli", 90),
    ("8b-64-f32", 120), ("8b-64-f64", 120),
]


def stamp() -> str:
    return datetime.now(UTC).strftime("%H:%M:%S")


def say(msg: str) -> None:
    print(f"[{stamp()}] {msg}", flush=True)


# -- the child side: one step, its partial results written as it goes ------------------------------------------


class Partial:
    """The step's results so far, rewritten to ``path`` at each :meth:`put` (the parent reads it if cut short)."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {}

    def put(self, **values: Any) -> None:
        self.data.update(values)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


class Meter:
    """Synchronized clocks and peak memory on a CUDA device (allocator peaks; the driver's use sampled at each
    :meth:`sample`), or on the CPU the process's peak RSS."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch, self.device = torch, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.driver_peak = 0

    def now(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def reset(self) -> None:
        from detjac.machine import reset_peak

        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats(self.device)
        reset_peak()  # the peak resident set starts again from the current one: steps share the worker process
        self.driver_peak = 0
        self.sample()

    def sample(self) -> None:
        if self.cuda:
            free, total = self.torch.cuda.mem_get_info(self.device)
            self.driver_peak = max(self.driver_peak, total - free)

    def peaks(self) -> dict[str, float]:
        from detjac.machine import peak_mib

        out = {"host_rss_peak_gib": peak_mib() / 1024}
        if self.cuda:
            self.sample()
            out.update(gpu_allocated_peak_gib=self.torch.cuda.max_memory_allocated(self.device) / 2**30,
                       gpu_reserved_peak_gib=self.torch.cuda.max_memory_reserved(self.device) / 2**30,
                       gpu_driver_used_peak_gib=self.driver_peak / 2**30)
        return out


def step_machine(args: argparse.Namespace, out: Partial) -> None:
    import platform

    import torch
    import transformers

    from .support.flops import matmul_flops

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


def _ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    import torch

    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step_exactness(args: argparse.Namespace, out: Partial) -> None:
    import torch

    from detjac.engine import detached_jacobian, load_model
    from detjac.engine.checkpoints.tiny import tiny_model

    s = sizes(args.dry_run)
    cases: dict[str, Callable[[], Any]] = {"default": lambda: load_model("default", dtype=torch.float64)}
    for family in FAMILIES:
        cases[family] = lambda family=family: tiny_model(family, dtype=torch.float64)
    rows: dict[str, Any] = {}
    for name, make in cases.items():
        model = make()
        vocab = model.config.get_text_config().vocab_size
        ids = _ids(vocab, s["exact_tokens"])
        ref = detached_jacobian(model, ids).jacobian
        scale = float(ref.abs().max())
        row: dict[str, Any] = {"tokens": len(ids)}
        for label, dtype, tf32 in (("float64", torch.float64, False), ("float32", torch.float32, False),
                                   ("float32_tf32", torch.float32, True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            on = model.to(device=args.device, dtype=dtype)
            res = detached_jacobian(on, ids, check=dtype == torch.float64)
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


def checkpoint(args: argparse.Namespace, which: str) -> Path:
    """The random bf16 checkpoint of ``which`` ("8b" or "70b") under ``--tmp``, written once and reused (a marker
    file holds its config); the default model's tokenizer copied in, so ``detjac run`` can read text."""
    import torch

    from detjac.engine.checkpoints.random_weights import write_random_checkpoint

    cfg = sizes(args.dry_run)[which]
    folder = Path(args.tmp) / f"{which}{'-dry' if args.dry_run else ''}"
    marker = folder / "gpu_check.json"
    if marker.is_file() and json.loads(marker.read_text()) == cfg:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    free = shutil.disk_usage(Path(args.tmp)).free
    say(f"writing the {which} checkpoint ({cfg['num_hidden_layers']} layers, bf16) to {folder}; "
        f"{free / 2**30:.0f} GiB free")
    t0 = time.perf_counter()
    total = write_random_checkpoint(folder, cfg, torch.bfloat16)
    from detjac.engine import resolve_model

    default = Path(resolve_model("default"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default / name).is_file():
            shutil.copy(default / name, folder / name)
    marker.write_text(json.dumps(cfg))
    say(f"{which} checkpoint: {total / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s")
    return folder


def _dry_budget(folder: Path, dtype: Any, tokens: int) -> str:
    """The dry run's CPU budget: what leaves room for about half the rows, so that the J takes two row blocks (as
    the real shapes do under 8 GiB)."""
    from detjac.engine import StreamedEngine

    cost = StreamedEngine(folder, dtype=dtype, max_memory="cpu=1GiB").cost
    rows = cost.d_model // 2 + 1
    return f"{cost.weights_bytes + cost.block_bytes(tokens, 0) + rows * cost.vector_bytes(tokens)}B"


def _budget(device: str, amount: str) -> str:
    return f"cpu={amount}" if device == "cpu" else f"{device}={amount}"  # the issue's --max-memory cuda:0=8GiB


def step_streamed(args: argparse.Namespace, out: Partial, which: str, tokens: int, dtype_name: str) -> None:
    """The output's J at ``tokens`` tokens on the ``which`` shape, layer-streamed under the budget."""
    import torch

    from detjac.engine import StreamedEngine, Target, reconstruct, relative_error
    from detjac.errors import InvalidArgumentError

    from .support.flops import matmul_flops, sweep_flops

    s = sizes(args.dry_run)
    cfg, dtype = s[which], getattr(torch, dtype_name)
    folder = checkpoint(args, which)
    meter = Meter(args.device)
    meter.reset()
    target = Target(-1, "output")
    refused: list[dict[str, str]] = []
    ladder = s["budgets"] if s["budgets"] else ["1MiB", _dry_budget(folder, dtype, tokens)]
    for amount in ladder:  # the smallest budget the engine takes for this shape, dtype and length
        budget = _budget(args.device, amount)
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
    ids = _ids(cfg["vocab_size"], tokens)
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
    if which == "70b":  # 80 layers: the middle layers' time scales with the depth; the top one is pulled once
        per_middle = _middle(spans, L)
        row["extrapolated_80_layers"] = {
            "jacobian_s": jacobian_s + (LAYERS_70B - L) * per_middle * plan.n_row_blocks,
            "forward_s": forward_s * LAYERS_70B / L,
            "note": "the middle layers' median seconds per row block times the 77 more layers and the row blocks; "
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
    budget = _budget(args.device, s["svd_budget"])
    engine = StreamedEngine(folder, dtype=torch.float32, device=args.device, max_memory=budget)
    ids = _ids(s["8b"]["vocab_size"], s["svd_tokens"])
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
    budget = s["budget"] or _dry_budget(folder, torch.float32, 32)  # the prompt has fewer than 32 tokens
    cmd = [detjac, "run", str(folder), str(prompt), "--out", str(work / "run.zarr"), "--dtype", "float32",
           "--device", args.device, "--max-memory", _budget(args.device, budget)]
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

    from detjac.engine import linearized, load_model

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
        ids = ours["ids"] if compared else _ids(s["8b"]["vocab_size"], n)
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
    if name.startswith("checkpoint-"):
        t0 = time.perf_counter()
        folder = checkpoint(args, name.removeprefix("checkpoint-"))
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        return out.put(folder=str(folder), gib=size / 2**30, seconds=time.perf_counter() - t0)
    which, length, dt = name.split("-")
    s = sizes(args.dry_run)
    return step_streamed(args, out, which, s["short"] if length == "16" else s["long"],
                         {"f32": "float32", "f64": "float64", "bf16": "bfloat16"}[dt])


# -- the parent side: deadlines, the log, gpu.json -----------------------------------------------------------


DONE = "@@gpu_check step done"


def worker(args: argparse.Namespace) -> None:
    """The child: reads step names on stdin, runs each (imports paid once), answers ``DONE name code`` on stdout."""
    import gc
    import traceback

    import torch

    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        code = 0
        try:
            run_step(name, args, Partial(args.out / f"step-{name}.json"))
        except BaseException as err:  # noqa: BLE001  reported, and the next step runs
            traceback.print_exc()
            code = err.code if isinstance(err, SystemExit) and isinstance(err.code, int) and err.code else 1
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"{DONE} {name} {code}", flush=True)


class Worker:
    """The worker process, its output echoed to the terminal and the log; :meth:`run` waits for one step's answer
    under a timeout (then the worker is killed, and the next step starts a new one)."""

    def __init__(self, args: argparse.Namespace, log: Any) -> None:
        cmd = [sys.executable, "-m", __spec__.name, "--worker", "--out", str(args.out), "--device",
               args.device, "--tmp", args.tmp, *(["--dry-run"] if args.dry_run else [])]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.answers: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self.log = log
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(DONE):
                name, code = line.split()[-2:]
                self.answers.put((name, int(code)))
                continue
            sys.stdout.write(line)
            sys.stdout.flush()
            if not self.log.closed:  # the parent closes the log once the last step is done
                self.log.write(line)
                self.log.flush()
        self.answers.put(None)  # the worker's output ended: it exited

    def run(self, name: str, timeout: float) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        try:
            answer = self.answers.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            return "cut_short"
        if answer is None:
            return f"failed (the worker died: exit {self.proc.wait()})"
        return "done" if answer[1] == 0 else f"failed (exit {answer[1]})"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self) -> None:
        if self.alive():
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def goals(steps: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, judged from what the run measured (``None``: not measured)."""

    def got(step: str, *keys: str) -> Any:
        value: Any = steps.get(step, {}).get("result", {})
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        return value

    peaks = {dt: got(f"70b-16-{dt}", "gpu_allocated_peak_gib") for dt in ("f32", "f64", "bf16")}
    used = {dt: got(f"70b-16-{dt}", "max_memory") for dt in ("f32", "f64", "bf16")}
    f32 = got("70b-16-f32", "extrapolated_80_layers", "jacobian_s")
    f64 = got("70b-16-f64", "extrapolated_80_layers", "jacobian_s")
    share = got("8b-16-f32", "share_of_matmul")
    svd = got("svd-1024", "seconds")
    measured = {dt: {"peak_gib": v, "max_memory": used[dt], "met": v <= 8.0} for dt, v in peaks.items()
                if v is not None}
    return {
        "70b_peak_gpu_le_8gib": measured or None,
        "70b_16_tokens_float32_le_120s": None if f32 is None else {"extrapolated_s": f32, "met": f32 <= 120},
        "70b_16_tokens_float64_le_300s": None if f64 is None else {"extrapolated_s": f64, "met": f64 <= 300},
        "8b_share_of_matmul_ge_0.5": None if share is None else {"measured": share, "met": share >= 0.5},
        "svd_1024_tokens_le_300s": None if svd is None else {"measured_s": svd, "met": svd <= 300},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="folder for gpu.json and gpu.log (created)")
    p.add_argument("--device", default=None, help="default: cuda:0 (cpu with --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="the same code paths at tiny shapes, on the CPU")
    p.add_argument("--budget-s", type=float, default=None, help=f"deadline for all steps (default {BUDGET_S:.0f} s)")
    p.add_argument("--only", default=None, help="comma-separated steps to run (default: all, in order)")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out")
    p.add_argument("--tmp", default=None, help="where the checkpoints go (default /tmp/detjac-gpu-check)")
    p.add_argument("--table", type=Path, help="print the docs table of this gpu.json, then stop")
    p.add_argument("--plans", action="store_true", help="print the planner's row blocks per budget, then stop")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--step-timeout-s", default="", help=argparse.SUPPRESS)  # the tests' cut: NAME=SECONDS,...
    args = p.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    if args.plans:
        print(plans())
        return
    if args.out is None:
        p.error("--out DIR is required")
    args.device = args.device or ("cpu" if args.dry_run else "cuda:0")
    args.tmp = args.tmp or "/tmp/detjac-gpu-check"
    Path(args.tmp).mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return
    names = [n for n, _ in STEPS]
    chosen = names if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    skipped = {n.strip() for n in args.skip.split(",") if n.strip()}
    unknown = sorted((set(chosen) | skipped) - set(names))
    if unknown:
        p.error(f"expected steps among {', '.join(names)}; got {', '.join(unknown)}")
    cuts = {k: float(v) for k, v in (item.split("=") for item in args.step_timeout_s.split(",") if item)}
    budget = args.budget_s if args.budget_s is not None else (600.0 if args.dry_run else BUDGET_S)
    deadline = time.monotonic() + budget
    result_file, log_file = args.out / "gpu.json", args.out / "gpu.log"
    report: dict[str, Any] = {"schema": SCHEMA, "dry_run": args.dry_run, "device": args.device,
                              "started_utc": datetime.now(UTC).isoformat(timespec="seconds"), "budget_s": budget,
                              "steps": {}}

    def save() -> None:
        report["goals"] = goals(report["steps"])
        tmp = result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        os.replace(tmp, result_file)

    with open(log_file, "a") as log:
        child: Worker | None = None
        try:
            for name, cap in STEPS:
                if name not in chosen or name in skipped:
                    continue
                left = deadline - time.monotonic() - RESERVE_S
                if left < MIN_STEP_S:
                    report["steps"][name] = {"status": "skipped",
                                             "why": f"{max(left, 0):.0f} s left of the {budget:.0f} s budget"}
                    say(f"{name}: skipped, {max(left, 0):.0f} s left")
                    save()
                    continue
                timeout = min(cap * (10 if args.dry_run else 1), left, cuts.get(name, left))
                partial = args.out / f"step-{name}.json"
                partial.unlink(missing_ok=True)
                say(f"{name}: started (at most {timeout:.0f} s)")
                t0 = time.monotonic()
                if child is None or not child.alive():
                    child = Worker(args, log)
                status = child.run(name, timeout)
                seconds = time.monotonic() - t0
                result = json.loads(partial.read_text()) if partial.is_file() else {}
                report["steps"][name] = {"status": status, "seconds": seconds, "result": result}
                say(f"{name}: {status} in {seconds:.1f} s")
                save()
        finally:
            if child is not None:
                child.close()
    report["finished_utc"] = datetime.now(UTC).isoformat(timespec="seconds")
    save()
    failed = [n for n, s in report["steps"].items() if s["status"].startswith("failed")]
    say(f"wrote {result_file}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    if failed:
        sys.exit(1)


PLAN_BUDGETS_GIB = (4, 8, 16, 24, 60)
# bytes per weight as stored: a bf16 checkpoint, and a GGUF of Q4_0 blocks (18 bytes per 32 weights)
PLAN_STORED = (("bf16", 2.0), ("Q4_0", 18 / 32))


def plans() -> str:
    """What the layer-streamed engine's planner (the same cost model, no weights needed) makes of the 8B and 70B
    shapes on a CUDA device: row blocks × rows of the output's J per budget (†: the layer in use widened a matrix at
    a time, CostModel.per_matrix), or "refused" where the layers' weights (two as stored: the one in use and the next,
    read ahead; the one in use widened to the compute dtype, whole or a matrix at a time) and one vector do not fit. A
    markdown table (docs/user-guide.md shows it)."""
    from detjac.engine import Target
    from detjac.engine.checkpoints.tiny import tiny_config
    from detjac.engine.streamed.cost import CostModel
    from detjac.errors import InvalidArgumentError

    lines = ["| shape | stored | dtype | tokens | one layer GiB (stored / compute) | "
             + " | ".join(f"{b} GiB" for b in PLAN_BUDGETS_GIB) + " |",
             "|---|---|---|---|---|" + "---|" * len(PLAN_BUDGETS_GIB)]
    for label, cfg in (("Llama-3.1-8B", LLAMA31_8B), ("Llama-3.3-70B", {**LLAMA33_70B, "num_hidden_layers": 80})):
        config = tiny_config("llama", **{k: v for k, v in cfg.items() if k != "model_type"})
        d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
        q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
        params = 2 * d * q + 2 * d * kv + 3 * d * f + 2 * d  # q, o, k, v, the MLP's three, two norms
        for stored, per_weight in PLAN_STORED:
            stored_bytes = int(params * per_weight)
            for dtype, itemsize in (("bfloat16", 2), ("float32", 4), ("float64", 8)):
                if per_weight > itemsize:
                    continue
                for tokens in (16, 64):
                    cells = []
                    for gib in PLAN_BUDGETS_GIB:
                        cost = CostModel.of(config, itemsize, params * itemsize, budget=gib * 2**30, device="cuda",
                                            stored_bytes=stored_bytes)
                        try:
                            plan = cost.plan(tokens, [Target(-1, "output")], mode="reverse")
                            cells.append(f"{plan.n_row_blocks} × {plan.row_block}"
                                         + (" †" if plan.widen == "matrix" else ""))
                        except InvalidArgumentError:
                            cells.append("refused")
                    lines.append(f"| {label} | {stored} | {dtype} | {tokens} | {stored_bytes / 2**30:.2f} / "
                                 f"{params * itemsize / 2**30:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(report: dict[str, Any]) -> str:
    """The markdown tables of the GPU section of docs/benchmarks.md: one row per streamed run, then the others."""
    steps = report["steps"]
    machine = steps.get("machine", {}).get("result", {})
    nan = float("nan")
    lines = [f"{machine.get('gpu', report['device'])}, torch {machine.get('torch')}, CUDA {machine.get('cuda')}",
             "", "| run | status | budget | blocks × rows | J s | s / layer / block | 80 layers s | TFLOP/s (× matmul) "
             "| peak GPU GiB (alloc / driver) | host RSS GiB | GiB to device | reconstruction |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, step in steps.items():
        r = step.get("result", {})
        if "row_block" not in r:
            continue
        done = "jacobian_s" in r
        budget = str(r.get("max_memory", "")).split(",")[0].split("=")[-1]
        whole = r.get("extrapolated_80_layers", {}).get("jacobian_s")
        lines.append(
            f"| {name} | {step['status']} | {budget} | {r['row_blocks']} × {r['row_block']} | "
            f"{r['jacobian_s']:.1f} | " if done else f"| {name} | {step['status']} | {budget} | "
            f"{r['row_blocks']} × {r['row_block']} | {len(r.get('seconds_per_block', []))} blocks done | "
        )
        lines[-1] += (
            f"{r.get('seconds_per_layer_per_row_block', nan):.3f} | {'–' if whole is None else f'{whole:.0f}'} | "
            f"{r.get('sweep_tflops', nan):.1f} ({r.get('share_of_matmul', nan):.2f}) | "
            f"{r.get('gpu_allocated_peak_gib', nan):.2f} / {r.get('gpu_driver_used_peak_gib', nan):.2f} | "
            f"{r.get('host_rss_peak_gib', nan):.1f} | {r.get('gib_host_to_device', nan):.1f} | "
            f"{r.get('reconstruction_error', nan):.1e} |"
        )
    lines += ["", "| step | status | figures |", "|---|---|---|"]
    for name, step in steps.items():
        r = step.get("result", {})
        if "row_block" in r:
            continue
        figures = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                            if not isinstance(v, dict | list) and k not in ("output_tail", "command"))
        if name == "exactness" and "models" in r:
            figures += "; " + ", ".join(
                f"{m} {x['float64']['rel_error_vs_cpu_float64']:.0e} / {x['float32']['rel_error_vs_cpu_float64']:.0e}"
                f" / {x['float32_tf32']['rel_error_vs_cpu_float64']:.0e}" for m, x in r["models"].items())
        if name == "reference" and "runs" in r:
            figures += "; " + ", ".join(
                f"{x['tokens']} tokens: " + ("out of memory" if x.get("out_of_memory") else f"{x['seconds']:.1f} s")
                for x in r["runs"])
        lines.append(f"| {name} | {step['status']}{': ' + step['why'] if 'why' in step else ''} | {figures} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
