"""The GPU check's tables (:mod:`benchmarks.gpu_check`): the planner's row blocks per budget at the 8B and 70B
shapes (``--plans``, shown in docs/user-guide.md), and a ``gpu.json``'s results (``--table``, for
docs/performance.md)."""

from __future__ import annotations

from typing import Any

from .gpu_run import LLAMA31_8B, LLAMA33_70B

PLAN_BUDGETS_GIB = (4, 8, 16, 24, 60)
# bytes per weight as stored: a bf16 checkpoint, and a GGUF of Q4_0 blocks (18 bytes per 32 weights)
PLAN_STORED = (("bf16", 2.0), ("Q4_0", 18 / 32))


def plans() -> str:
    """What the layer-streamed engine's planner (the same cost model, no weights needed) makes of the 8B and 70B
    shapes on a CUDA device: row blocks × rows of the output's J per budget (†: the layer in use widened a matrix at
    a time, CostModel.per_matrix), or "refused" where the layers' weights (two as stored: the one in use and the next,
    read ahead; the one in use widened to the compute dtype, whole or a matrix at a time) and one vector do not fit. A
    markdown table (docs/user-guide.md shows it)."""
    from detjac.engine.checkpoints.tiny import tiny_config
    from detjac.engine.cost import CostModel
    from detjac.errors import InvalidArgumentError
    from detjac.targets import Target

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
    """The markdown tables of the GPU section of docs/performance.md: one row per streamed run, then the others."""
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
