"""The ``gpu`` section of ``benchmarks/streamed.py``: the layer-streamed engine at real model shapes on a GPU.

Two runs, each on a random-weight bf16 safetensors checkpoint written to a temporary
folder (deleted afterwards), each with a 32-token prompt and the final-output Jacobian
(``Target(-1, "output")``, shape ``(d, n, d)``) computed in reverse-mode row blocks:

llama3-70b-shape
    The Llama-3-70B config (d 8192, ffn 28672, 64/8 heads of 128, vocabulary 128256) with
    3 of its 80 decoder layers (``--quick``: 2 layers, vocabulary 32000), every linear
    weight through bitsandbytes' nf4 round trip as it is streamed in. Reported: peak GPU
    memory, forward-pass seconds, seconds per layer per row block, the Jacobian's total
    seconds and its row blocks, and the extrapolation to 80 layers: time grows linearly
    with the layers; peak memory is one layer plus the activations, so only the forward
    trace ((2L + 2) n d values) grows with L.
qwen3-14b-shape
    The Qwen3-14B config (d 5120, ffn 17408, 40/8 heads of 128, 40 layers, vocabulary
    151936; ``--quick``: 4 layers) in bf16 under ``max_memory="<device>=8GiB,cpu=32GiB"``:
    the engine sizes the row block to the 8 GiB budget; ``within_budget`` says whether the
    peak allocated GPU memory stayed under it.

Row blocks go to a CPU tensor as they come (never the whole Jacobian on the GPU), so the
peak reflects the engine. Timings synchronize the device. The checkpoints need disk
space: about 9.2 GB (70B shape, 3 layers) and 29.5 GB (14B shape, 40 layers), one at a
time, under ``--tmp`` (default: the system's temporary folder).

    cd benchmarks && ../.venv/bin/python gpu_streamed.py --out results/gpu_streamed.json
    ../.venv/bin/python gpu_streamed.py --device cpu --tiny   # a smoke test of the code paths

On ``--device cpu`` no CUDA call is made: peak memory is the process's peak RSS instead.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from detjac.machine import peak_mib

from .support.flops import sweep_flops
from .support.random_weights import write_random_checkpoint

TOKENS = 32
LLAMA3_70B_LAYERS = 80

# Llama-3-70B (meta-llama/Meta-Llama-3-70B config.json); the number of layers is set per run.
LLAMA3_70B: dict[str, Any] = dict(
    model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=LLAMA3_70B_LAYERS,
    num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
    rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False,
)
# Qwen3-14B (Qwen/Qwen3-14B config.json): full attention in every layer (no sliding window).
QWEN3_14B: dict[str, Any] = dict(
    model_type="qwen3", hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
    num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
    rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
    use_sliding_window=False, sliding_window=None, max_window_layers=40,
)
# Smoke-test sizes (CPU): the same code paths on d=256, 2 layers, vocabulary 1000.
_TINY: dict[str, Any] = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=64)

RUNS = ("llama3-70b-shape", "qwen3-14b-shape")


def _configs(quick: bool = False, tiny: bool = False) -> dict[str, dict[str, Any]]:
    """The two runs' specs: model config, quantization, GPU budget (GiB, None: no budget) and row block.

    The 70B-shaped run gets a 16 GiB budget so the engine picks a row block of about a
    thousand rows (the default without a budget, 64, would stream every layer 128 times).
    ``tiny`` keeps the structure (GQA, head_dim, nf4, a budget that splits the rows into
    blocks) at smoke-test sizes.
    """
    llama = {**LLAMA3_70B, "num_hidden_layers": 2 if quick else 3}
    if quick:
        llama["vocab_size"] = 32000
    qwen = {**QWEN3_14B, "num_hidden_layers": 4} if quick else dict(QWEN3_14B)
    specs = {
        "llama3-70b-shape": {"cfg": llama, "quantize": "nf4", "budget_gib": 16.0, "row_block": None,
                             "extrapolate_to": LLAMA3_70B_LAYERS},
        "qwen3-14b-shape": {"cfg": qwen, "quantize": None, "budget_gib": 8.0, "row_block": None,
                            "extrapolate_to": QWEN3_14B["num_hidden_layers"]},
    }
    if tiny:
        for spec in specs.values():
            spec["cfg"] = {**spec["cfg"], **_TINY}
            spec["budget_gib"] = 0.05  # about 200 of the 256 rows per block: two row blocks
    return specs


def _torch() -> Any:
    import torch

    return torch


class _Meter:
    """Device synchronization and peak memory, CUDA or (on ``cpu``) the process's peak RSS."""

    def __init__(self, device: str) -> None:
        self.torch = _torch()
        self.cuda = self.torch.device(device).type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        if self.cuda:
            self.sync()
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> dict[str, float]:
        if self.cuda:
            return {"allocated_gib": self.torch.cuda.max_memory_allocated(self.device) / 2**30,
                    "reserved_gib": self.torch.cuda.max_memory_reserved(self.device) / 2**30}
        return {"rss_mib": peak_mib()}

    def now(self) -> float:
        self.sync()
        return time.perf_counter()


def _max_memory(device: str, budget_gib: float | None) -> str | None:
    if budget_gib is None:
        return None
    return f"cpu={budget_gib}GiB" if device == "cpu" else f"{device}={budget_gib}GiB,cpu=32GiB"


def _one_run(name: str, spec: dict[str, Any], device: str, tmp: Path, tokens: int) -> dict[str, Any]:
    torch = _torch()
    from detjac.engine import StreamedEngine
    from detjac.engine.result import reconstruct
    from detjac.exactness import relative_error
    from detjac.targets import Target

    cfg, meter = spec["cfg"], _Meter(device)
    folder = tmp / name
    print(f"[{name}] writing a random bf16 checkpoint ({cfg['num_hidden_layers']} layers) to {folder}", flush=True)
    t0 = time.perf_counter()
    try:
        on_disk = write_random_checkpoint(folder, cfg, torch.bfloat16)
        write_s = time.perf_counter() - t0
        print(f"[{name}] {on_disk / 2**30:.2f} GiB written in {write_s:.1f} s", flush=True)

        meter.reset()
        max_memory = _max_memory(device, spec["budget_gib"])
        t0 = meter.now()
        sm = StreamedEngine(folder, dtype=torch.bfloat16, device=device, max_memory=max_memory,
                           quantize=spec["quantize"])
        init_s = meter.now() - t0
        load_s = [0.0]
        load_layer = sm.load_layer

        def timed_load(i: int) -> None:  # read + host-to-device copy (+ quantization round trip)
            t = meter.now()
            load_layer(i)
            load_s[0] += meter.now() - t

        sm.load_layer = timed_load  # type: ignore[method-assign]
        L, d, n = sm.n_layers, sm.d_model, tokens
        ids = torch.randint(3, cfg["vocab_size"], (n,), generator=torch.Generator().manual_seed(0)).tolist()
        target = Target(-1, "output")

        print(f"[{name}] forward pass over {L} layers, {n} tokens", flush=True)
        t0 = meter.now()
        trace = sm.trace(ids)
        forward_s = meter.now() - t0
        peak_forward = meter.peak()
        plan = sm.plan(trace, [target], row_block=spec["row_block"], mode="reverse")
        print(f"[{name}] forward {forward_s:.2f} s; Jacobian in {plan.n_row_blocks} row blocks of {plan.row_block}",
              flush=True)

        jac = torch.empty(d, n, d, dtype=torch.bfloat16)  # on the CPU: the GPU holds one block at a time
        per_block: list[float] = []
        load_s[0], loaded_before = 0.0, sm.stats.layers_loaded
        t_start = t_block = meter.now()
        for k, b in enumerate(sm.blocks(trace, [target], plan), 1):
            jac[b.start:b.stop] = b.values.to("cpu")
            del b
            t = meter.now()
            per_block.append(t - t_block)
            print(f"[{name}] row block {k}/{plan.n_row_blocks}: {per_block[-1]:.2f} s "
                  f"({per_block[-1] / L:.3f} s per layer)", flush=True)
            t_block = t
        jacobian_s = meter.now() - t_start
        peak = meter.peak()
        loads = sm.stats.layers_loaded - loaded_before

        finite = bool(torch.isfinite(jac).all())
        recon = relative_error(reconstruct(jac.float(), trace.embeddings.float().cpu()), trace.output.float().cpu())
        sane = finite and tuple(jac.shape) == (d, n, d)
        print(f"[{name}] Jacobian {jacobian_s:.1f} s; finite {finite}; reconstruction error {recon:.2e}; "
              f"peak {peak}", flush=True)

        trace_bytes = (2 * L + 2) * n * d * 2
        row: dict[str, Any] = {
            "config": cfg, "layers": L, "tokens": n, "dtype": "bfloat16", "quantize": spec["quantize"],
            "device": device, "max_memory": max_memory, "weights_on_disk_gib": on_disk / 2**30,
            "write_checkpoint_s": write_s, "init_s": init_s,
            "layer_gib": sm.skeleton.layer_bytes() / 2**30, "trace_mib": trace_bytes / 2**20,
            "forward_pass_s": forward_s, "row_block": plan.row_block, "row_blocks": plan.n_row_blocks,
            "jacobian_s": jacobian_s, "seconds_per_row_block": per_block,
            "seconds_per_layer_per_row_block": statistics.median(per_block) / L,
            "layer_loads": loads, "layer_load_s": load_s[0], "layer_load_s_each": load_s[0] / max(loads, 1),
            "gib_read": sm.stats.bytes_read / 2**30,
            "sweep_tflops": sweep_flops(cfg, n, d, L) / jacobian_s / 1e12,
            "jacobian_shape": list(jac.shape), "finite": finite, "sane": sane,
            "reconstruction_rel_error": recon, "max_abs": float(jac.abs().max()),
        }
        if meter.cuda:
            row.update({"gpu": torch.cuda.get_device_name(device),
                        "peak_gpu_gib": peak["allocated_gib"], "peak_gpu_reserved_gib": peak["reserved_gib"],
                        "peak_gpu_forward_gib": peak_forward["allocated_gib"]})
            peak_value = peak["allocated_gib"]
        else:
            row["peak_rss_mib"] = peak["rss_mib"]
            peak_value = None
        if spec["budget_gib"] is not None:
            row["budget_gib"] = spec["budget_gib"]
            if peak_value is not None:
                row["within_budget"] = peak_value <= spec["budget_gib"]
                row["reserved_within_budget"] = peak["reserved_gib"] <= spec["budget_gib"]
        to = spec["extrapolate_to"]
        if to != L:
            more_trace = (2 * to + 2) * n * d * 2 - trace_bytes
            decoded = f", decoded from {spec['quantize']}" if spec["quantize"] else ""
            row[f"extrapolated_{to}_layers"] = {
                "forward_pass_s": forward_s * to / L,
                "jacobian_s": jacobian_s * to / L,
                "peak_gpu_gib": None if peak_value is None else peak_value + more_trace / 2**30,
                "note": (f"time is linear in the layers (every row block streams each layer once); peak memory is "
                         f"one layer ({row['layer_gib']:.2f} GiB in bf16{decoded}) plus the "
                         f"row block's vectors and the trace, of which only the trace ((2L+2) n d values: "
                         f"+{more_trace / 2**20:.0f} MiB) grows with L"),
            }
        del jac, trace, sm
        return row
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        print(f"[{name}] checkpoint deleted", flush=True)


def run_gpu(device: str = "cuda:0", quick: bool = False, *, tiny: bool = False, runs: Sequence[str] = RUNS,
            tmp: str | Path | None = None, tokens: int = TOKENS,
            sizes: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Both runs (or those in ``runs``); ``sizes`` overrides :func:`_configs`' specs by run name."""
    torch = _torch()
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"gpu section: {device} requested but CUDA is not available")
    specs = _configs(quick, tiny)
    for name, override in (sizes or {}).items():
        specs[name] = {**specs[name], **override}
    bad = [r for r in runs if r not in specs]
    if bad:
        raise SystemExit(f"unknown runs {bad}; expected some of {list(specs)}")
    import bitsandbytes
    import transformers

    results: dict[str, Any] = {"machine": {"torch": torch.__version__, "transformers": transformers.__version__,
                                           "bitsandbytes": bitsandbytes.__version__,
                                           "python": sys.version.split()[0], "quick": quick, "tiny": tiny}}
    with tempfile.TemporaryDirectory(dir=tmp) as folder:
        for name in runs:
            results[name] = _one_run(name, specs[name], device, Path(folder), tokens)
            print(json.dumps({name: {k: v for k, v in results[name].items() if k != "config"}}), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--quick", action="store_true", help="fewer layers (checks the script runs on a GPU)")
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes (d=256, 2 layers), e.g. with --device cpu")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--tmp", type=Path, default=None, help="where the checkpoints are written (needs ~30 GB)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args()
    results = run_gpu(args.device, args.quick, tiny=args.tiny, runs=args.runs, tmp=args.tmp)
    text = json.dumps(results, indent=1) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
