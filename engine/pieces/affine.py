"""The pieces of affine families (biases, centred LayerNorms, GPT-2's ``Conv1D``, ungated MLPs), for the explicit
sweeps (:mod:`detjac.engine.pieces.layer`).

The sweeps apply the linear part only: offsets stay outside ``J``, and :func:`layer_offsets` lets the layer check
compare linear parts. Details: docs/engine.md, "Piece kinds"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..detach.factors import FactorTape
from ..detach.wrappers import DetachedActivation
from . import NotAPiece
from .lazy import ATTR


def projection(module: Any, affine: bool) -> torch.Tensor:
    """The (out, in) weight of a projection on the linear path (a bias only where the family declares itself
    affine: the bias is an offset, outside ``J``); raises :class:`~detjac.engine.pieces.NotAPiece` (why) where it
    is not one. A module of a layer loaded a matrix at a time gives its :class:`~.lazy.LazyWeight`."""
    if type(module) is nn.Linear and (module.bias is None or affine):
        return getattr(module, ATTR, None) or module.weight
    if type(module) is Conv1D and affine:  # GPT-2: y = x W + b with W (in, out)
        return module.weight.T
    raise NotAPiece(f"{type(module).__name__} is not a bias-free nn.Linear" + (" or a Conv1D" if affine else ""))


def centre(core: Any, before: bool) -> None:
    """Fold a centring ``x - mean(x)`` into the core's projection next to it: before the core, each row of the
    input projection loses its mean (``W C``); after it, each column of the output projection (``C W``)."""
    if hasattr(core, "centre"):
        core.centre(before)
        return
    name = {"Mlp": ("up", "down"), "Attention": ("value", "out")}[type(core).__name__][0 if before else 1]
    w = getattr(core, name)
    setattr(core, name, w - w.mean(dim=1 if before else 0, keepdim=True))


def attention_weights(module: nn.Module, heads: int, kvh: int, hd: int, affine: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(value (kv_heads * hd, d), output (d, heads * hd)) projections of an attention block: ``v_proj``, a fused
    ``qkv_proj`` [q | k | v] (Phi3) or GPT-2's fused ``c_attn``; ``o_proj`` or GPT-2's ``c_proj``. Raises
    :class:`~detjac.engine.pieces.NotAPiece` (why, the value's first) where either is not a known projection."""
    if hasattr(module, "v_proj"):
        value = projection(module.v_proj, affine)
    elif hasattr(module, "qkv_proj"):  # fused [q | k | v] rows (Phi3)
        value = projection(module.qkv_proj, affine)[(heads + kvh) * hd:]
    elif hasattr(module, "c_attn"):  # fused [q | k | v] output columns of a Conv1D (GPT-2)
        value = projection(module.c_attn, affine)[(heads + kvh) * hd:]
    else:
        raise NotAPiece(f"{type(module).__name__} has none of v_proj, qkv_proj, c_attn")
    out_proj = getattr(module, "o_proj", None) or getattr(module, "c_proj", None)
    if out_proj is None:
        raise NotAPiece(f"{type(module).__name__} has no o_proj, c_proj")
    return value, projection(out_proj, affine)


def ungated_mlp(module: nn.Module, children: list[nn.Module], factor: torch.Tensor, affine: bool,
                make: Callable[..., Any]) -> Any:
    """An MLP container ``proj_out(act(proj_in(x)))`` (dropouts aside; ``children``: its children while it ran) with
    the activation's ratio frozen, as the gated-MLP piece ``make(up, down, gate)``; raises
    :class:`~detjac.engine.pieces.NotAPiece` (why) where it is not one."""
    gate = factor.reshape(-1, factor.shape[-1])  # (n, ffn)
    up, down = (projection(c, affine) for c in ungated_projections(module, children, gate.shape[1], affine))
    return make(up, down, gate)


def ungated_projections(module: nn.Module, children: list[nn.Module], width: int, affine: bool
                        ) -> tuple[nn.Module, nn.Module]:
    """The (in, out) projection modules of an ungated MLP container whose activation is ``width`` wide: in
    registration order, unless the shapes say otherwise (GPT-2 registers ``c_proj`` first); raises
    :class:`~detjac.engine.pieces.NotAPiece` (why) where it is not one."""
    parts = [c for c in children if not isinstance(c, nn.Dropout | nn.Identity) or c.training]
    acts = [c for c in parts if isinstance(c, DetachedActivation) and c.detach]
    others = [c for c in parts if c not in acts]
    if len(acts) != 1 or len(others) != 2:
        raise NotAPiece(f"{type(module).__name__} is not a projection, a detached activation and a projection")
    up, down = (projection(c, affine) for c in others)
    if up.shape[0] != width or down.shape[1] != width:
        return others[1], others[0]
    return others[0], others[1]


def layer_offsets(step: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], factors: list[Any],
                  h: torch.Tensor, down: nn.Module | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A layer's offsets ``c`` (output, mid residual), each (n, d): the layer run on zero inputs with the frozen
    factors of its real input replayed (``factors``, in call order); and, given the MLP's ``down`` projection, its
    neurons' values in that run (n, ffn): the input ``down`` received (else None)."""
    tape = FactorTape()
    tape.factors = list(factors)
    seen: list[torch.Tensor] = []
    handle = down.register_forward_pre_hook(lambda m, a: seen.append(a[0])) if down is not None else None
    try:
        with tape.replaying_factors(), torch.no_grad():
            out, mid = step(torch.zeros_like(h))
    finally:
        if handle is not None:
            handle.remove()
    neurons = seen[0].reshape(-1, seen[0].shape[-1]) if len(seen) == 1 else None
    return out, mid, neurons
