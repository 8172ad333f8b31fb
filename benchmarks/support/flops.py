"""What a row sweep costs in FLOPs, and how fast this device multiplies: their ratio is a sweep's efficiency
(achieved FLOP/s over ``torch.matmul``'s), as the benchmarks and the GPU check report it. The memory side of the
cost is :mod:`.cost`."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch


def sweep_flops(cfg: Mapping[str, Any], n: int, rows: int, layers: int, queries: int | None = None) -> float:
    """FLOPs of pulling ``rows`` vectors of ``n`` positions back through ``layers`` layers of a model of config
    ``cfg`` (``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``,
    ``head_dim``).

    Per vector and layer: the transposed value, output, up and down projections
    (``2 n (d kv + d q + 2 d f)``, q/kv the widths of all query/key-value heads) and the
    transposed frozen-probability products (``2 n^2 q``). A layer pulled back from the outputs of
    its last ``queries`` positions only (the top layer in reverse mode: its cotangents are zero
    before the target position) does the value projection over all n positions and the rest over
    ``queries``: ``2 n d kv + 2 queries (d q + 2 d f) + 2 queries n q``. Norm scales, the gate product and
    the per-layer recomputed forward are not counted (they are O(n d) per vector or O(1)
    in the number of vectors).
    """
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    m = n if queries is None else queries
    per = 2 * n * d * kv + 2 * m * (d * q + 2 * d * f) + 2 * m * n * q
    return float(per * rows * layers)


def matmul_flops(dtype: Any, device: str = "cpu", size: int = 2048, repeat: int = 5, *,
                 shape: tuple[int, int, int] | None = None, tf32: bool = False) -> float:
    """FLOP/s of one ``torch.matmul`` (best of ``repeat``): square ``size``, or ``(m, k) @ (k, n)`` for
    ``shape=(m, k, n)``; ``tf32`` lets a CUDA float32 product use TF32 (restored afterwards)."""
    m, k, n = shape or (size, size, size)
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    before, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, tf32
    try:
        best = float("inf")
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            if device != "cpu":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return 2 * m * k * n / best
