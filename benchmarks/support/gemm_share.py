"""Where a sweep's time goes: its GEMMs replayed alone, and a profile by kind of op.

Used by ``benchmarks/adjoint_sweeps.py`` and ``benchmarks/real_speed.py`` to split the gap between a sweep's rate
and ``torch.matmul``'s (:mod:`.flops`) in two:

- :func:`record_gemms` runs a function once under a ``TorchDispatchMode`` and records every matrix
  product it runs at the ATen level (``mm``, ``addmm``, ``bmm``, ``baddbmm``, in place or not) with its
  operands' shapes, strides and scalars; :func:`replay_seconds` runs exactly those calls again on
  random operands of the same layout (same thread count, same process), so
  ``gemm_flops / replay_seconds`` is ``torch.matmul``'s rate *on the sweep's own GEMM shapes*;
- :func:`profile_kinds` runs it under ``torch.profiler`` and sums the ops' own CPU time by kind
  (GEMM, copies and layout changes, element-wise, the rest).

Never used in tests: this is a measurement.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_GEMMS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "addbmm", "addbmm_"}
_COPIES = {"copy_", "clone", "contiguous", "cat", "zeros", "zero_", "fill_", "new_zeros", "zeros_like",
           "empty_like", "index_put_", "_unsafe_view", "reshape", "permute", "transpose", "view", "slice",
           "select", "expand", "as_strided", "t", "unsqueeze", "squeeze", "stack", "narrow", "_reshape_alias",
           "index", "empty", "new_empty", "resize_", "alias", "detach", "lift_fresh", "split", "chunk"}
_ELEMENTWISE = {"mul", "mul_", "add", "add_", "sub", "sub_", "div", "div_", "neg", "ne", "any", "nonzero",
                "rsqrt", "pow", "mean", "sum", "sigmoid", "silu", "exp", "softmax", "_softmax", "where", "abs",
                "max", "lt", "gt", "eq", "masked_fill", "masked_fill_", "addcmul_", "to", "_to_copy", "rsub"}


@dataclass(frozen=True)
class Gemm:
    """One recorded matrix product: the ATen op and, per argument, a tensor layout or a plain value."""

    op: Any
    args: tuple[Any, ...]  # ("T", shape, stride, dtype) or a non-tensor value
    kwargs: tuple[tuple[str, Any], ...]

    def flops(self) -> float:
        shapes = [a[1] for a in self.args if isinstance(a, tuple) and a and a[0] == "T"]
        a, b = shapes[-2], shapes[-1]  # (.., m, k) @ (.., k, n)
        batch = a[0] if len(a) == 3 else 1
        return 2.0 * batch * a[-2] * a[-1] * b[-1]


def _layout(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype)
    return x


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Gemm] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in _GEMMS:
            self.calls.append(Gemm(func, tuple(_layout(a) for a in args),
                                   tuple(sorted((k, _layout(v)) for k, v in kwargs.items()))))
        return func(*args, **kwargs)


def record_gemms(fn: Callable[[], Any]) -> list[Gemm]:
    """Every matrix product ``fn()`` runs, in order."""
    rec = _Recorder()
    with rec:
        fn()
    return rec.calls


def gemm_flops(calls: list[Gemm]) -> float:
    return sum(c.flops() for c in calls)


def _operands(calls: list[Gemm]) -> dict[Any, torch.Tensor]:
    """One random tensor per distinct layout (reused across calls, as the sweep reuses its weights)."""
    out: dict[Any, torch.Tensor] = {}
    for c in calls:
        for a in (*c.args, *(v for _, v in c.kwargs)):
            if isinstance(a, tuple) and a and a[0] == "T" and a not in out:
                _, shape, stride, dtype = a
                t = torch.empty_strided(shape, stride, dtype=dtype)
                t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0).normal_()
                out[a] = t
    return out


def replay_seconds(calls: list[Gemm], operands: dict[Any, torch.Tensor] | None = None) -> float:
    """Seconds to run ``calls`` again, alone, on random operands of the recorded layouts."""
    ops = operands if operands is not None else _operands(calls)

    def real(a: Any) -> Any:
        return ops[a] if isinstance(a, tuple) and a and a[0] == "T" else a

    prepared = [(c.op, [real(a) for a in c.args], {k: real(v) for k, v in c.kwargs}) for c in calls]
    t0 = time.perf_counter()
    for op, args, kwargs in prepared:
        op(*args, **kwargs)
    return time.perf_counter() - t0


def shape_table(calls: list[Gemm]) -> list[dict[str, Any]]:
    """The distinct GEMM shapes, how often each ran and its share of the GEMM FLOPs."""
    total = gemm_flops(calls) or 1.0
    counts = Counter((c.op.overloadpacket.__name__,
                      tuple(a[1] for a in c.args if isinstance(a, tuple) and a and a[0] == "T")) for c in calls)
    flops = Counter()
    for c in calls:
        flops[(c.op.overloadpacket.__name__,
               tuple(a[1] for a in c.args if isinstance(a, tuple) and a and a[0] == "T"))] += c.flops()
    return [{"op": op, "shapes": [list(s) for s in shapes], "calls": counts[(op, shapes)],
             "flop_share": flops[(op, shapes)] / total}
            for (op, shapes) in sorted(flops, key=lambda k: -flops[k])]


def kind_of(name: str) -> str:
    base = name.removeprefix("aten::")
    if base in _GEMMS or base in ("matmul", "linear"):
        return "gemm"
    if base in _COPIES:
        return "copies"
    if base in _ELEMENTWISE:
        return "elementwise"
    return "other"


def profile_kinds(fn: Callable[[], Any], top: int = 12) -> dict[str, Any]:
    """``fn()`` under ``torch.profiler``: wall seconds, the ops' own CPU seconds by kind, and the top ops."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    by_kind: Counter[str] = Counter()
    for e in events:
        by_kind[kind_of(e.key)] += e.self_cpu_time_total / 1e6
    ops = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return {"wall_seconds": wall, "self_seconds_by_kind": dict(by_kind),
            "top_ops": [{"op": e.key, "calls": e.count, "self_seconds": e.self_cpu_time_total / 1e6,
                         "kind": kind_of(e.key)} for e in ops]}
