"""An attention piece head by head: what each head reads from a block of tangents and what each head's output
receives of a block of cotangents.

The attention piece (:class:`~detjac.engine.pieces.layer.Attention`) computes ``y = W_o [P_h V_kv(h) x]_h`` with its
norms folded in (the scales before it in ``P``'s columns, a norm after it, Gemma's and OLMo 2's, in ``P``'s rows and
``W_o``), so head ``h``'s output is ``W_o,h P_h V_kv(h) x``: its share of the attention's output through the frozen
norm after it. The heads act in parallel, so ``y`` is exactly the sum of the heads' outputs. An affine family's value
and output biases are constants: outside these linear maps (the layer's bias node). Used by the head loadings of
attribution graphs (:mod:`detjac.graphs.head_loadings`) and the QK attribution's components
(:mod:`detjac.engine.tools.qk_residual`)."""

from __future__ import annotations

import torch

from .layer import Attention
from .lazy import wide


def head_values(attention: Attention, x: torch.Tensor) -> torch.Tensor:
    """(B, n, d) vectors at the layer's input -> (B, heads, n, hd) each head's mix of values ``P_h V_kv(h) x``."""
    b, n, _ = x.shape
    heads, hd, kvh = attention.probs.shape[0], attention.head_dim, attention.kv_heads
    v = (x @ wide(attention.value).T).view(b, n, kvh, hd).transpose(1, 2)  # (B, kv_heads, n, hd)
    return attention.probs @ v.repeat_interleave(heads // kvh, dim=1)  # (heads, n, n) @ (B, heads, n, hd)


def head_cotangents(attention: Attention, g: torch.Tensor) -> torch.Tensor:
    """(B, n, d) cotangents at the attention's output -> (B, heads, n, hd) at each head's value mix (``g W_o,h``)."""
    b, n, _ = g.shape
    heads, hd = attention.probs.shape[0], attention.head_dim
    return (g @ wide(attention.out)).view(b, n, heads, hd).transpose(1, 2)


def heads_output(attention: Attention, mixed: torch.Tensor) -> torch.Tensor:
    """(B, heads, n, hd) the heads' value mixes -> (B, n, d) the attention's output, their sum through ``W_o``."""
    b, heads, n, hd = mixed.shape
    return mixed.transpose(1, 2).reshape(b, n, heads * hd) @ wide(attention.out).T


def head_outputs(attention: Attention, x: torch.Tensor) -> torch.Tensor:
    """(n, d) at the layer's input -> (heads, n, d) each head's output ``W_o,h P_h V_kv(h) x``."""
    heads, hd = attention.probs.shape[0], attention.head_dim
    out = wide(attention.out)
    w_o = out.view(out.shape[0], heads, hd)  # (d, heads, hd)
    return torch.einsum("hnk,dhk->hnd", head_values(attention, x[None])[0], w_o)
