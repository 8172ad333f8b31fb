"""A post-norm layer (BERT) as explicit pieces, for the explicit sweeps (:mod:`detjac.engine.pieces.layer`).

The norms sit on the residual sums, so they are applied after each sum (their transposes before it) instead of being
folded into a core; a layer of another shape is refused with the reason (:class:`~detjac.engine.pieces.NotAPiece`).
Details: docs/engine.md, "Piece kinds"."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..detach.wrappers import DetachedActivation, DetachedNorm
from . import NotAPiece
from .affine import projection
from .layer import Attention, LayerPieces, Mlp
from .norms import NormPiece, norm_piece


def post_norm_pieces(record: Any) -> LayerPieces:
    """A post-norm layer's :class:`~detjac.engine.pieces.record.LayerRecord` as pieces (see the module docstring);
    raises :class:`~detjac.engine.pieces.NotAPiece` (why) where it is not one."""
    family, factors = record.family, record.factors
    first, second = ([c for c in part if not _identity(c.module)] for part in record.branches)
    shape = "an attention block, then an MLP input and an MLP output module"
    if len(first) != 1 or len(second) != 2 or len(record.probs) != 1:
        raise NotAPiece(f"a post-norm layer that is not {shape}")
    block, f0, f1 = first[0].module, first[0].first, first[0].end
    inner = [m for m in block.children() if not _identity(m)]
    attention = [m for m in inner if type(m) in family.attentions]
    if len(inner) != 2 or len(attention) != 1 or f1 is None or f1 - f0 != 2:
        raise NotAPiece(f"{type(block).__name__} is not an attention and a post-norm residual sum")
    summed = _residual_sum(next(m for m in inner if m is not attention[0]), factors[f1 - 1], family.affine)
    core = _attention(attention[0], record.probs[0], summed[0], family.affine)
    (mlp_in, a0, a1), (mlp_out, b0, b1) = ((c.module, c.first, c.end) for c in second)
    parts = [m for m in mlp_in.children() if not _identity(m)]
    if len(parts) != 2 or not isinstance(parts[1], DetachedActivation) or a1 != a0 + 1 or b1 != b0 + 1:
        raise NotAPiece(f"{type(mlp_in).__name__} is not a projection and a detached activation")
    up = projection(parts[0], family.affine)
    down, down_norm = _residual_sum(mlp_out, factors[b0], family.affine)
    gate = factors[a0].reshape(-1, up.shape[0])  # (n, ffn): the activation's frozen ratio
    return LayerPieces(core, Mlp(up, down, gate), summed[1], down_norm)


def _identity(module: nn.Module) -> bool:
    return isinstance(module, nn.Dropout | nn.Identity) and not module.training


def _residual_sum(module: nn.Module, factor: torch.Tensor, affine: bool) -> tuple[torch.Tensor, NormPiece]:
    """An output module ``N(W x + residual)`` (dropouts aside) as (W, N with its frozen scale); raises
    :class:`~detjac.engine.pieces.NotAPiece` (why) where it is not one."""
    parts = [m for m in module.children() if not _identity(m)]
    if len(parts) != 2 or not isinstance(parts[1], DetachedNorm):
        raise NotAPiece(f"{type(module).__name__} is not a projection and a norm of the residual sum")
    return projection(parts[0], affine), norm_piece(parts[1], factor.reshape(-1))


def _attention(module: Any, probs: torch.Tensor, out: torch.Tensor, affine: bool) -> Attention:
    """A self-attention without its own output projection (BERT's ``value``; ``W_o``, ``out``, is in the output
    module)."""
    heads, hd = int(module.num_attention_heads), int(module.attention_head_size)
    value = projection(getattr(module, "value", None), affine)
    if value.shape[0] != heads * hd or out.shape[1] != heads * hd or probs.shape[0] != heads:
        raise NotAPiece(f"{type(module).__name__}: head shapes that do not match the config")
    return Attention(value, out, probs, heads, hd)
