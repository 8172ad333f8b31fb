"""A frozen norm as an explicit piece: its per-position scale, gain and centring (:class:`NormPiece`), made from a
detached norm (:func:`norm_piece`, :func:`frozen_norm`) for the layer pieces (:mod:`detjac.engine.pieces.layer`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..detach.factors import FactorTape
from ..detach.wrappers import DetachedNorm
from . import NotAPiece


@dataclass
class NormPiece:
    """A frozen norm: per-position scale (n,), gain (d,) or None (no weight), and for a LayerNorm the centring
    ``x - mean(x)`` first (its bias is an offset, outside ``J``)."""

    scale: torch.Tensor
    gain: torch.Tensor | None
    center: bool = False

    def apply(self, x: torch.Tensor, s: int = 0) -> torch.Tensor:  # (..., n - s, d), positions s: -> same
        if self.center:
            x = x - x.mean(-1, keepdim=True)
        y = x * self.scale[s:, None]
        return y * self.gain if self.gain is not None else y

    def transpose(self, x: torch.Tensor, s: int = 0) -> torch.Tensor:  # (..., n - s, d), positions s: -> same
        y = (x * self.gain if self.gain is not None else x) * self.scale[s:, None]
        return y - y.mean(-1, keepdim=True) if self.center else y


def norm_piece(norm: nn.Module, scale: torch.Tensor) -> NormPiece:
    """A detached norm (RMS, or a centred LayerNorm) with its frozen scale (n,) as a :class:`NormPiece`; raises
    :class:`~detjac.engine.pieces.NotAPiece` (why) where it is not a known piece."""
    if not isinstance(norm, DetachedNorm) or not norm.detach:
        raise NotAPiece(f"{type(norm).__name__} is not a detached norm")
    weight = getattr(norm.inner, "weight", None)
    if weight is None:  # output norm(x) * offset, or norm(x)
        return NormPiece(scale * norm.offset if norm.offset else scale, None, norm.center)
    weight = weight.to(scale.dtype)
    return NormPiece(scale, weight + norm.offset if norm.offset else weight, norm.center)


def frozen_norm(norm: nn.Module, x: torch.Tensor) -> NormPiece:
    """The norm ``norm`` at ``x`` (n, d) as a :class:`NormPiece`; raises :class:`~detjac.engine.pieces.NotAPiece`
    (why) where it is not a known piece."""
    if not isinstance(norm, DetachedNorm):
        raise NotAPiece(f"{type(norm).__name__} is not a detached norm")
    tape = FactorTape()
    with tape.recording(), torch.no_grad():
        norm(x)
    return norm_piece(norm, tape.factors[0].reshape(-1))
