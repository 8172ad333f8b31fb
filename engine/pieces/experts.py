"""A detached mixture-of-experts block as an explicit piece (:mod:`detjac.engine.pieces.layer`).

:class:`Moe` runs each expert's two projections on the positions routed to it, gathered and scattered back, its
routing weight folded into its frozen gate: ``top_k`` expert MLPs per position, never experts × positions. Details:
docs/engine.md, "Piece kinds"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..detach.moe import DetachedMoE
from . import NotAPiece


@dataclass
class Expert:
    """One expert: the positions routed to it and its gated MLP over them (routing weight folded into the gate)."""

    rows: torch.Tensor  # (hits,) positions, ascending
    up: torch.Tensor  # (ffn, d)
    down: torch.Tensor  # (d, ffn)
    gate: torch.Tensor  # (hits, ffn): w_{t,e} act(gate_e(x_t))
    index: int = 0  # the expert's number in its block


@dataclass
class Moe:
    """``y_t = sum_e [t routed to e] W_down,e (post_t gate_e,t ⊙ W_up,e x_t)``; norms folded in (see the module
    docstring). Its neurons are each expert's, numbered ``e * ffn + i`` (``e`` the expert's index in the block),
    zero where a position is not routed to the expert; the routing weight is part of the neuron's frozen gate."""

    experts: list[Expert]
    n_experts: int = 0  # experts in the block (hit or not): the neurons' numbering
    post: torch.Tensor | None = None  # (n,) the scales of the norms after the block, None: none

    mixes = False  # position-wise

    def fold(self, scale: torch.Tensor, gain: torch.Tensor | None, before: bool) -> None:
        if not before:
            self.post = scale if self.post is None else self.post * scale
        for e in self.experts:
            if before:
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

    def _gate(self, e: Expert) -> torch.Tensor:
        return e.gate if self.post is None else e.gate * self.post[e.rows, None]

    def _into(self, acc: torch.Tensor, sa: int, x: torch.Tensor, s: int, own: bool, up: bool
              ) -> tuple[torch.Tensor, int]:
        out = acc if own else acc.clone()
        b, d = x.shape[0], x.shape[2]
        for e in self.experts:
            keep = e.rows >= s
            idx, gate = e.rows[keep] - s, self._gate(e)[keep]
            if idx.numel() == 0:
                continue
            first, second = (e.up.T, e.down.T) if up else (e.down, e.up)
            h = idx.numel()
            z = (x.index_select(1, idx).reshape(b * h, d) @ first).view(b, h, -1).mul_(gate)
            out.index_add_(1, idx + (s - sa), (z.view(b * h, -1) @ second).view(b, h, d))
        return out, sa


    # -- the neurons (attribution graphs): see the class docstring --------------------------------

    @property
    def ffn(self) -> int:
        return int(self.experts[0].down.shape[1]) if self.experts else 0

    @property
    def n_neurons(self) -> int:
        return self.n_experts * self.ffn

    def _span(self, e: Expert) -> slice:
        return slice(e.index * self.ffn, (e.index + 1) * self.ffn)

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        """(n, d) the block's input -> (n, experts · ffn) its neurons' values."""
        z = x.new_zeros(x.shape[0], self.n_neurons)
        for e in self.experts:
            z[e.rows, self._span(e)] = e.gate * (x[e.rows] @ e.up.T)
        return z

    def neuron_cotangents(self, g: torch.Tensor) -> torch.Tensor:
        """(B, n, d) cotangents at the block's output -> (B, n, experts · ffn) at its neurons."""
        post = self.post[:, None] if self.post is not None else None
        gz = g.new_zeros(g.shape[0], g.shape[1], self.n_neurons)
        for e in self.experts:
            part = g[:, e.rows] @ e.down
            gz[:, e.rows, self._span(e)] = part if post is None else part * post[e.rows]
        return gz

    def neuron_seeds(self, gz: torch.Tensor) -> torch.Tensor:
        """(B, n, experts · ffn) cotangents at the neurons -> (B, n, d) at the block's input."""
        d = self.experts[0].up.shape[1] if self.experts else 0
        g = gz.new_zeros(gz.shape[0], gz.shape[1], d)
        for e in self.experts:
            g[:, e.rows] += (gz[:, e.rows, self._span(e)] * e.gate) @ e.up
        return g

    def _slots(self, pos: torch.Tensor, idx: torch.Tensor) -> list[tuple[Expert, int, int]]:
        """Each neuron (``e * ffn + j`` at position ``p``) as (its expert, its row among the expert's positions, j)."""
        by_index = {e.index: e for e in self.experts}
        out = []
        for p, i in zip(pos.tolist(), idx.tolist(), strict=True):
            e = by_index[i // self.ffn]
            row = (e.rows == p).nonzero()
            assert row.numel() == 1, "a neuron of an expert its position was not routed to has no value"
            out.append((e, int(row[0]), i % self.ffn))
        return out

    def read_rows(self, pos: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """(m, d) what each neuron reads from the block's input (its gate at its position times its up row)."""
        return torch.stack([e.gate[r, j] * e.up[j] for e, r, j in self._slots(pos, idx)])

    def write_rows(self, pos: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """(m, d) what each neuron writes per unit of its value."""
        rows = [e.down[:, j] for e, _, j in self._slots(pos, idx)]
        w = torch.stack(rows)
        return w if self.post is None else w * self.post[pos, None]

    def write_vectors(self) -> torch.Tensor:
        """(experts · ffn, d) each neuron's write vector (:meth:`Mlp.write_vectors`); NaN for an expert that no
        position of the prompt was routed to (its weights are not part of the prompt's pieces)."""
        d = self.experts[0].down.shape[0] if self.experts else 0
        w = torch.full((self.n_neurons, d), float("nan"),
                       dtype=self.experts[0].down.dtype if self.experts else torch.float32)
        for e in self.experts:
            w[self._span(e)] = e.down.T
        return w

    def output(self, z: torch.Tensor) -> torch.Tensor:
        """(n, experts · ffn) neuron values -> (n, d) the block's output."""
        d = self.experts[0].down.shape[0] if self.experts else 0
        out = z.new_zeros(z.shape[0], d)
        for e in self.experts:
            out[e.rows] += z[e.rows, self._span(e)] @ e.down.T
        return out if self.post is None else out * self.post[:, None]


def moe_piece(module: Any, factors: list[Any]) -> Moe:
    """A :class:`~detjac.engine.detach.moe.DetachedMoE` call's frozen factors (the routing ``(weights, chosen)``,
    then one ``act(gate_e(x))`` per hit expert, ascending) as a :class:`Moe`; raises
    :class:`~detjac.engine.pieces.NotAPiece` (why) where they are not."""
    if not isinstance(module, DetachedMoE) or not module.detach:
        raise NotAPiece(f"{type(module).__name__} is not a detached mixture of experts")
    weights, chosen = factors[0]  # (tokens, top_k) each
    hit = torch.unique(chosen).tolist()
    if len(factors) != 1 + len(hit):
        raise NotAPiece(f"{type(module).__name__}: {len(factors) - 1} expert factors for {len(hit)} experts hit")
    experts = getattr(module.inner, module.rule.experts)
    out = []
    for e, act in zip(hit, factors[1:], strict=True):
        rows, slot = torch.where(chosen == e)
        gate_up, down = experts.gate_up_proj[e], experts.down_proj[e]  # (2 ffn, d), (d, ffn)
        ffn = down.shape[1]
        gate = act.reshape(rows.numel(), ffn) * weights[rows, slot, None].to(act.dtype)
        out.append(Expert(rows, gate_up[ffn:], down, gate, int(e)))
    return Moe(out, int(experts.gate_up_proj.shape[0]))
