"""Detached sparse mixture-of-experts blocks (Qwen3-MoE, Mixtral, OLMoE).

The router's choice and weights are one frozen factor and each chosen expert's ``act(gate(x))`` another, leaving
``sum_e w_e * down_e(A_e * up_e(x))``, linear in ``x``. Details: docs/engine.md, "Mixture of experts"."""

from __future__ import annotations

import torch
from torch import nn

from detjac.errors import UnsupportedModelError

from ..families.base import MoeRule
from .factors import freeze
from .wrappers import DetachedModule


class DetachedMoE(DetachedModule):
    """``sum over chosen experts e of w_e(x) * down_e(act(gate_e(x)) * up_e(x))`` with ``w``, the choice and
    every ``act(gate_e(x))`` frozen."""

    def __init__(self, inner: nn.Module, rule: MoeRule, detach: bool) -> None:
        super().__init__(inner, detach)
        self.rule = rule
        experts = getattr(inner, rule.experts)
        layout = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
                  "has_post_expert_norm": False}
        odd = [f"{k}={getattr(experts, k)}" for k, v in layout.items() if getattr(experts, k, v) != v]
        if odd or not all(hasattr(experts, a) for a in ("gate_up_proj", "down_proj", "act_fn")):
            raise UnsupportedModelError(
                f"Expected {type(experts).__name__} to hold fused gate_up_proj (experts, 2 * ffn, d) and down_proj "
                f"(experts, d, ffn) tensors without biases. Got {', '.join(odd) or 'other attributes'}."
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (batch, seq, d) -> (batch, seq, d)
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])  # (tokens, d)
        router = getattr(self.inner, self.rule.router)
        experts = getattr(self.inner, self.rule.experts)
        weights, chosen = freeze(lambda: router(x)[1:], self.detach)  # (tokens, top_k) each
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():  # ascending, as the stock loop over hit experts
            token_idx, slot = torch.where(chosen == e)
            xe = x[token_idx]  # (hits, d)
            gate, up = nn.functional.linear(xe, experts.gate_up_proj[e]).chunk(2, dim=-1)  # (hits, ffn)
            act = freeze(lambda gate=gate: experts.act_fn(gate), self.detach)
            ye = nn.functional.linear(act * up, experts.down_proj[e]) * weights[token_idx, slot, None]
            out = out.index_add(0, token_idx, ye.to(out.dtype))
        return out.reshape(shape)

    def linear_modules(self) -> list[tuple[str, nn.Module]]:
        """Nothing to walk: the experts' tensors are used directly above, the router only feeds frozen factors."""
        return []
