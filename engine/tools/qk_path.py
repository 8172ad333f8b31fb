"""The query and key path of one attention layer, run by the stock modules on any batch of residual-stream vectors with
the norm scales frozen at their values on the prompt (the QK attribution's bilinear form,
:mod:`detjac.engine.tools.qk`).

Nothing about the path is restated here: the decoder layer's own forward runs (its input norm, its query and key
projections, fused or not, its q/k norms, per head or over the whole projection, its rotary embedding with the cos and
sin the decoder gave that layer, partial rotary and Gemma's local and global bases included) up to its attention
function, which is replaced for the call by one that keeps what it receives (``query``, ``key``, the additive mask,
``scaling`` and ``softcap``) and stops the layer there. Run once on the layer's real input with a
:class:`~detjac.engine.detach.factors.FactorTape` recording, the norms' frozen factors are kept; replayed on other
vectors, every norm applies the real input's scale, so ``query`` and ``key`` are affine in those vectors and exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from ..detach.factors import FactorTape

QK_CAPTURE = "detjac_qk_capture"


@dataclass
class Captured:
    """What one call of the layer's attention function received (the batch's rows)."""

    query: torch.Tensor  # (batch, heads, n, hd): after q norm and rotary embedding
    key: torch.Tensor  # (batch, kv_heads, n, hd)
    mask: torch.Tensor | None  # (1 or batch, 1, n, n) additive, finfo.min where blocked
    scaling: float
    softcap: float | None


class _Reached(Exception):
    """Raised by the capturing attention function to stop the layer once its query and key are kept."""


_SINK: ContextVar[list[Captured] | None] = ContextVar("detjac_qk_sink", default=None)


def _capture(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, *, scaling: float | None = None, softcap: float | None = None,
             **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    sink = _SINK.get()
    assert sink is not None, "the capturing attention function runs inside QkPath.run only"
    sink.append(Captured(query, key, attention_mask, float(query.shape[-1] ** -0.5 if scaling is None else scaling),
                         None if softcap is None else float(softcap)))
    raise _Reached


def _register() -> None:
    AttentionInterface.register(QK_CAPTURE, _capture)
    AttentionMaskInterface.register(QK_CAPTURE, eager_mask)


@dataclass
class QkPath:
    """Layer ``layer`` of a linearized model (inside :func:`~detjac.engine.linearized`) as it ran on the prompt:
    the module, the attention block inside it and the arguments the decoder called it with."""

    layer: nn.Module
    attention: nn.Module
    args: tuple[Any, ...]  # the call's positional arguments after the hidden states
    kwargs: dict[str, Any]

    def __post_init__(self) -> None:
        self.tape = FactorTape()

    @contextmanager
    def _capturing(self) -> Iterator[list[Captured]]:
        _register()
        config = self.attention.config
        before = config._attn_implementation
        sink: list[Captured] = []
        token = _SINK.set(sink)
        config._attn_implementation = QK_CAPTURE
        try:
            yield sink
        finally:
            config._attn_implementation = before
            _SINK.reset(token)

    def _reach(self, hidden: torch.Tensor) -> Captured:  # (batch, n, d)
        with self._capturing() as sink, torch.no_grad():
            try:
                self.layer(hidden, *self.args, **self.kwargs)
            except _Reached:
                pass
        if len(sink) != 1:
            raise RuntimeError(f"Expected the layer to call its attention function once. Got {len(sink)} calls.")
        return sink[0]

    def record(self, h: torch.Tensor) -> Captured:
        """The layer's real input ``h`` (n, d): its query and key, mask, scaling and soft-cap, the norms' factors
        kept."""
        self.tape = FactorTape()
        with self.tape.recording():
            return self._reach(h[None])

    def run(self, vectors: torch.Tensor) -> Captured:
        """(batch, n, d) residual-stream vectors -> their query and key with every norm's factor replayed (affine in
        the vectors: an affine family's constants are the run on zeros)."""
        with self.tape.replaying_factors():
            return self._reach(vectors)


def attention_child(layer: nn.Module, family: Any) -> nn.Module:
    """The attention block among a decoder layer's children (its type is one of ``family.attentions``)."""
    found = [m for m in layer.modules() if type(m) in family.attentions]
    if len(found) != 1:
        raise RuntimeError(f"Expected one attention block in {type(layer).__name__}. Got {len(found)}.")
    return found[0]
