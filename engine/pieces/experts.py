"""A detached mixture-of-experts block as an explicit piece (:mod:`detjac.engine.pieces.layer`).

:class:`Moe` runs each expert's two projections on the positions routed to it, gathered and scattered back, its
routing weight folded into its frozen gate: ``top_k`` expert MLPs per position, never experts × positions. Details:
docs/engine.md, "Piece kinds"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..detach.moe import DetachedMoE


@dataclass
class Expert:
    """One expert: the positions routed to it and its gated MLP over them (routing weight folded into the gate)."""

    rows: torch.Tensor  # (hits,) positions, ascending
    up: torch.Tensor  # (ffn, d)
    down: torch.Tensor  # (d, ffn)
    gate: torch.Tensor  # (hits, ffn): w_{t,e} act(gate_e(x_t))


@dataclass
class Moe:
    """``y_t = sum_e [t routed to e] W_down,e (gate_e,t ⊙ W_up,e x_t)``; norms folded in (see the module docstring)."""

    experts: list[Expert]

    mixes = False  # position-wise

    def fold(self, scale: torch.Tensor, gain: torch.Tensor | None, before: bool) -> None:
        for e in self.experts:
            e.gate = e.gate * scale[e.rows, None]
            if gain is not None:
                if before:
                    e.up = e.up * gain[None, :]
                else:
                    e.down = gain[:, None] * e.down

    def centre(self, before: bool) -> None:
        """Fold a centring ``x - mean(x)`` before (into each ``W_up``'s columns) or after (``W_down``'s rows)."""
        for e in self.experts:
            if before:
                e.up = e.up - e.up.mean(dim=1, keepdim=True)
            else:
                e.down = e.down - e.down.mean(dim=0, keepdim=True)

    def push_into(self, acc: torch.Tensor, sa: int, x: torch.Tensor, s: int, own: bool = False
                  ) -> tuple[torch.Tensor, int]:
        """``acc`` (c, n - sa, d) plus the block applied to ``x`` (c, n - s, d), s >= sa."""
        return self._into(acc, sa, x, s, own, up=True)

    def pull_into(self, acc: torch.Tensor, sa: int, g: torch.Tensor, s: int, own: bool = False
                  ) -> tuple[torch.Tensor, int]:
        """``acc`` (B, n - sa, d) plus the block's transpose applied to ``g`` (B, n - s, d), s >= sa."""
        return self._into(acc, sa, g, s, own, up=False)

    def _into(self, acc: torch.Tensor, sa: int, x: torch.Tensor, s: int, own: bool, up: bool
              ) -> tuple[torch.Tensor, int]:
        out = acc if own else acc.clone()
        b, d = x.shape[0], x.shape[2]
        for e in self.experts:
            keep = e.rows >= s
            idx, gate = e.rows[keep] - s, e.gate[keep]
            if idx.numel() == 0:
                continue
            first, second = (e.up.T, e.down.T) if up else (e.down, e.up)
            h = idx.numel()
            z = (x.index_select(1, idx).reshape(b * h, d) @ first).view(b, h, -1).mul_(gate)
            out.index_add_(1, idx + (s - sa), (z.view(b * h, -1) @ second).view(b, h, d))
        return out, sa


def moe_piece(module: Any, factors: list[Any]) -> Moe | str:
    """A :class:`~detjac.engine.detach.moe.DetachedMoE` call's frozen factors (the routing ``(weights, chosen)``,
    then one ``act(gate_e(x))`` per hit expert, ascending) as a :class:`Moe`, or why they are not."""
    if not isinstance(module, DetachedMoE) or not module.detach:
        return f"{type(module).__name__} is not a detached mixture of experts"
    weights, chosen = factors[0]  # (tokens, top_k) each
    hit = torch.unique(chosen).tolist()
    if len(factors) != 1 + len(hit):
        return f"{type(module).__name__}: {len(factors) - 1} expert factors for {len(hit)} experts hit"
    experts = getattr(module.inner, module.rule.experts)
    out = []
    for e, act in zip(hit, factors[1:], strict=True):
        rows, slot = torch.where(chosen == e)
        gate_up, down = experts.gate_up_proj[e], experts.down_proj[e]  # (2 ffn, d), (d, ffn)
        ffn = down.shape[1]
        gate = act.reshape(rows.numel(), ffn) * weights[rows, slot, None].to(act.dtype)
        out.append(Expert(rows, gate_up[ffn:], down, gate))
    return Moe(out)
