"""The detached building blocks: norm, gated-MLP and activation wrappers and the attention function.

Each computes what the stock module computes with its factor ``A(x)`` detached (through
:func:`detjac.engine.detach.factors.freeze`), in the input's dtype; with ``detach`` off, the ordinary Jacobian of the
same computation. Details: docs/engine.md, "The detached wrappers"."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from detjac.errors import UnsupportedModelError

from ..families.base import MlpRule, NormRule
from .activations import Ratio, activation_ratio
from .factors import freeze

DETACHED_ATTENTION = "detjac_detached"
EXACT_ATTENTION = "detjac_exact"


def _factor_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype in which a frozen factor is computed: the input's, but never below float32."""
    return torch.promote_types(dtype, torch.float32)


class DetachedModule(nn.Module):
    """Base of the wrappers. ``linear_children`` names the children on the linear path."""

    linear_children: tuple[str, ...] = ()

    def __init__(self, inner: nn.Module, detach: bool) -> None:
        super().__init__()
        self.inner = inner
        self.detach = detach


class DetachedNorm(DetachedModule):
    """RMSNorm ``x * s(x) * (offset + w)``, or LayerNorm ``(x - mean(x)) * s(x) * w + b`` (``rule.center``),
    with the scale ``s = 1/sqrt(mean(x_c^2) + eps)`` of the (centred) input frozen.

    Centring is linear, so it stays on the path; only the scale is frozen.
    """

    def __init__(self, inner: nn.Module, rule: NormRule, detach: bool) -> None:
        super().__init__(inner, detach)
        self.eps = float(getattr(inner, rule.eps_attr))
        self.offset = rule.weight_offset
        self.center = rule.center
        shape = getattr(inner, "normalized_shape", None)
        if shape is not None and len(shape) != 1:
            raise UnsupportedModelError(
                f"Expected a norm over the last dimension only. Got {type(inner).__name__} over {tuple(shape)}."
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., d)
        if self.center:
            x = x - x.mean(-1, keepdim=True)
        xf = x.to(_factor_dtype(x.dtype))
        scale = freeze(lambda: torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype),
                       self.detach)  # (..., 1)
        out = x * scale
        weight = getattr(self.inner, "weight", None)
        if weight is not None:
            weight = weight.to(x.dtype)
            out = out * (weight + self.offset if self.offset else weight)
        elif self.offset:
            out = out * self.offset
        bias = getattr(self.inner, "bias", None) if self.center else None
        return out + bias.to(x.dtype) if bias is not None else out


class DetachedActivation(DetachedModule):
    """An ungated activation ``f(z) = z * r(z)`` with the ratio ``r(z)`` frozen (see
    :mod:`detjac.engine.detach.activations`)."""

    def __init__(self, inner: nn.Module, ratio: Ratio, detach: bool) -> None:
        super().__init__(inner, detach)
        self.ratio = ratio

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        factor = freeze(lambda: self.ratio(z.to(_factor_dtype(z.dtype))).to(z.dtype), self.detach)
        return z * factor


class DetachedGatedMLP(DetachedModule):
    """``down(act(gate(x)) * up(x))`` with the whole ``act(gate(x))`` branch frozen (convention ``up``), or with
    ``up(x)`` and the ratio ``r(g) = act(g) / g`` frozen, so that ``g = gate(x)`` keeps the linear path (``gate``)."""

    def __init__(self, inner: nn.Module, rule: MlpRule, detach: bool, convention: str = "up") -> None:
        super().__init__(inner, detach)
        self.rule, self.convention = rule, convention
        self.ratio: Ratio | None = None
        if convention == "gate":
            self.ratio = activation_ratio(getattr(inner, rule.act))
            if self.ratio is None:
                raise UnsupportedModelError(f"Expected an activation written as g * r(g) for the gate convention. "
                                            f"Got {type(getattr(inner, rule.act)).__name__}.")
        linear = rule.gate if convention == "gate" else rule.up
        self.linear_children = (rule.gate_up, rule.down) if rule.fused else (linear, rule.down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., d)
        r, inner = self.rule, self.inner
        act = getattr(inner, r.act)
        if self.ratio is not None:
            return getattr(inner, r.down)(self._gate_path(x))
        if r.fused:
            gate, up = getattr(inner, r.gate_up)(x).chunk(2, dim=-1)  # (..., i) each
            return getattr(inner, r.down)(freeze(lambda: act(gate), self.detach) * up)
        # The gate projection runs inside the frozen branch on the detached input: forward-mode
        # products then push no tangents through it (reverse mode never pulled any back).
        factor = freeze(lambda: act(getattr(inner, r.gate)(x.detach() if self.detach else x)), self.detach)
        return getattr(inner, r.down)(factor * getattr(inner, r.up)(x))

    def _gate_path(self, x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., i): g * frozen(r(g) * up(x))
        r, inner, ratio = self.rule, self.inner, self.ratio
        assert ratio is not None
        if r.fused:
            gate, up = getattr(inner, r.gate_up)(x).chunk(2, dim=-1)
        else:  # the up projection runs inside the frozen factor on the detached input (no tangents through it)
            gate, up = getattr(inner, r.gate)(x), getattr(inner, r.up)(x.detach() if self.detach else x)
        factor = freeze(lambda: ratio(gate.to(_factor_dtype(gate.dtype))).to(gate.dtype) * up, self.detach)
        return gate * factor

    def linear_modules(self) -> list[tuple[str, nn.Module]]:
        """Children of the wrapped MLP that stay on the linear path, with their names."""
        return [(f"inner.{n}", getattr(self.inner, n)) for n in self.linear_children]


class DetachedInput(DetachedModule):
    """A child of an attention block that feeds only the frozen probabilities (a query or key projection):
    it runs on the detached input, so forward-mode products push no tangents through it."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner(x.detach() if self.detach else x, *args, **kwargs)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, kv_heads, seq, hd) -> (batch, kv_heads * n_rep, seq, hd), as grouped-query attention needs."""
    if n_rep == 1:
        return x
    b, h, s, hd = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, hd).reshape(b, h * n_rep, s, hd)


def grouped_product(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``probs @ repeat_kv(value)`` without repeating the values: (batch, heads, q, kv) x (batch, kv_heads, kv, hd)
    -> (batch, heads, q, hd).

    The ``n_rep`` query heads that share a key-value head are stacked along the query axis, so one
    matmul per key-value head does their work; its pullback sums over the group inside the matmul
    instead of reducing a repeated copy.
    """
    b, h, q, kv = probs.shape
    kvh = value.shape[1]
    if h == kvh:
        return torch.matmul(probs, value)
    grouped = torch.matmul(probs.reshape(b, kvh, (h // kvh) * q, kv), value)
    return grouped.reshape(b, h, q, value.shape[-1])


class AttentionReplay:
    """Lets a causal decoder layer compute the outputs of a suffix of the positions only.

    :meth:`record` runs the full-sequence layer once and keeps each attention call's values and
    frozen probabilities; :meth:`replay` then serves the suffix's calls: the recorded prefix values go
    in front of the suffix's own and the recorded probability rows of the suffix's queries are used.
    The suffix's primal output, and so every position-wise frozen factor after the attention, equals
    the full run's. Two uses:

    - forward-mode tangents that are zero before ``start``: the prefix values are recorded as
      constants (their tangent is zero);
    - ``record(live=True)`` inside a function being differentiated, for cotangents that are zero
      before ``start`` (reverse mode): the prefix values stay functions of the layer's input, so the
      pullback reaches every position through them while the output projection and the MLP run on the
      suffix only.
    """

    def __init__(self) -> None:
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []  # (value, probs) per attention call
        self.start: int | None = None
        self.live = False
        self._cursor = 0

    @contextmanager
    def record(self, live: bool = False) -> Iterator[None]:
        self.records, self.start, self.live = [], None, live
        token = _REPLAY.set(self)
        try:
            yield
        finally:
            _REPLAY.reset(token)

    @contextmanager
    def replay(self, start: int) -> Iterator[None]:
        self.start, self._cursor = start, 0
        token = _REPLAY.set(self)
        try:
            yield
        finally:
            _REPLAY.reset(token)

    def causal(self) -> bool:
        """Whether every recorded query attends only to itself and earlier positions."""
        return all(not torch.triu(probs, diagonal=1).any() for _, probs in self.records)

    def serve(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(full values, probability rows of the suffix's queries) for the next attention call."""
        if self._cursor >= len(self.records):
            raise RuntimeError("A suffix replay made more attention calls than the recorded full run.")
        full_value, probs = self.records[self._cursor]
        self._cursor += 1
        start = self.start
        return torch.cat([full_value[:, :, :start], value], dim=2), probs[:, :, start:]


_REPLAY: ContextVar[AttentionReplay | None] = ContextVar("detjac_attention_replay", default=None)


def _attention(
    module: nn.Module,
    query: torch.Tensor,  # (batch, heads, q_len, hd)
    key: torch.Tensor,  # (batch, kv_heads, kv_len, hd)
    value: torch.Tensor,  # (batch, kv_heads, kv_len, hd)
    attention_mask: torch.Tensor | None,  # (batch, 1, q_len, kv_len), additive
    *,
    scaling: float,
    detach: bool,
    softcap: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    n_rep = getattr(module, "num_key_value_groups", 1)
    replay = _REPLAY.get()
    if replay is not None and replay.start is not None:  # a suffix of the queries (see AttentionReplay)
        value, probs = replay.serve(value)
        out = grouped_product(probs, value)
        return out.transpose(1, 2).contiguous(), probs
    key = repeat_kv(key, n_rep)
    fdt = _factor_dtype(query.dtype)

    def probabilities() -> torch.Tensor:  # (batch, heads, q_len, kv_len)
        scores = torch.matmul(query.to(fdt), key.to(fdt).transpose(2, 3)) * scaling
        if softcap is not None:  # inside the softmax, so frozen with it
            scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            scores = scores + attention_mask[:, :, :, : key.shape[-2]].to(fdt)
        return torch.softmax(scores, dim=-1).to(query.dtype)

    probs = freeze(probabilities, detach)
    if replay is not None:
        replay.records.append((value if replay.live else value.detach(), probs.detach()))
    out = grouped_product(probs, value)  # (batch, heads, q_len, hd)
    return out.transpose(1, 2).contiguous(), probs


def detached_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: torch.Tensor | None,
                       **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with ``softmax(QK^T * scale + mask)`` frozen: only ``probs @ V`` stays."""
    return _attention(module, query, key, value, attention_mask, detach=True, **kwargs)


def exact_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The same eager attention without detaching (for the ordinary Jacobian)."""
    return _attention(module, query, key, value, attention_mask, detach=False, **kwargs)


def register_attention() -> None:
    """Register both attention functions and their masks with transformers (idempotent).

    A function registered under a new name gets ``attention_mask=None`` (no causal, no
    sliding-window mask) unless a mask function is registered under the same name, so
    eager's additive 4-D mask, sliding windows included, is registered with it.
    """
    for name, fn in ((DETACHED_ATTENTION, detached_attention), (EXACT_ATTENTION, exact_attention)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, eager_mask)
