"""A detached layer's run recorded, and read as pieces (:mod:`detjac.engine.pieces.layer`) from the family declaration.

:func:`record_layer` runs a layer once with hooks on its children (a :class:`LayerRecord`); :meth:`LayerRecord.pieces`
reads each residual branch as one core recognised by kind, or raises :class:`~detjac.engine.pieces.NotAPiece`
saying why it cannot. Details: docs/engine.md, "Piece kinds"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..detach.factors import FactorTape
from ..detach.moe import DetachedMoE
from ..detach.wrappers import AttentionReplay, DetachedGatedMLP, DetachedNorm
from . import NotAPiece
from .affine import attention_weights, centre, layer_offsets, projection, ungated_mlp, ungated_projections
from .experts import moe_piece
from .layer import Attention, LayerPieces, Mlp
from .norms import NormPiece, norm_piece
from .postnorm import post_norm_pieces


@dataclass
class Call:
    """One call of a layer's child while the layer ran: the frozen factors it added are ``factors[first:end]`` of
    the tape (``end`` is None until the call returns)."""

    name: str
    module: nn.Module
    first: int
    children: list[nn.Module]  # the module's children as they were during the call (wrapped: linearized)
    end: int | None = None


@dataclass
class Offsets:
    """An affine layer's constants: what it computes on a zero input with its frozen factors replayed (each
    position's attention and MLP biases, its norms' shifts); the linear pieces leave them out."""

    out: torch.Tensor  # (n, d) the layer's output
    mid: torch.Tensor  # (n, d) its mid residual
    neurons: torch.Tensor | None  # (n, ffn) its MLP's neurons (None: an MLP whose down projection is not known)


@dataclass
class LayerRecord:
    """What one run of a detached layer froze: its children's calls (:class:`Call`) on either side of the mid residual,
    indexing ``factors`` (the tape's), and each attention call's probabilities."""

    family: Any
    branches: tuple[list[Call], list[Call]]
    factors: list[Any]
    probs: list[torch.Tensor]  # (heads, n, n) per attention call, in call order
    fixed: LayerPieces | None = None  # pieces that fold nothing (post-norm layers), built once while recording
    offsets: Offsets | None = None  # an affine family's constants

    def pieces(self, own: bool = False) -> LayerPieces:
        """The layer's pieces, norms folded in (new tensors each time: nothing is kept between sweeps); raises
        :class:`~detjac.engine.pieces.NotAPiece` (why) where a branch is not made of known pieces. ``own``: the
        layer's weights are the caller's to change (a streamed layer widened for this block): the norm gains are
        folded into them in place, once every branch is known, instead of into copies."""
        if self.fixed is not None:
            return self.fixed
        probs = list(self.probs)
        branches = [_branch(part, self.family, self.factors, probs) for part in self.branches]
        for core, norms in branches:
            _fold(core, norms, own)
        attention, mlp = (core for core, _ in branches)
        if self.offsets is not None and self.offsets.neurons is not None and isinstance(mlp, Mlp):
            mlp.offsets(self.offsets.neurons, self.offsets.mid, self.offsets.out)
        return LayerPieces(attention, mlp)


def record_layer(layer: nn.Module, family: Any, step: Any, h: torch.Tensor, tape: FactorTape | None = None
                 ) -> tuple[LayerRecord, torch.Tensor, torch.Tensor]:
    """Run ``step`` (the detached layer, (n, d) -> (out, mid)) on ``h`` once, recording every child's frozen
    factors (into ``tape``, default a new one); return the record and the linear part of the layer's (out, mid):
    less the offsets of an affine family's layer. Raises :class:`~detjac.engine.pieces.NotAPiece` (why) where the
    layer is not made of a known structure."""
    calls: list[Call] = []
    tape, replay = tape if tape is not None else FactorTape(), AttentionReplay()
    start = len(tape.factors)
    handles = []
    for name, child in layer.named_children():
        handles.append(child.register_forward_pre_hook(
            lambda m, a, name=name: calls.append(Call(name, m, len(tape.factors), list(m.children())))))
        handles.append(child.register_forward_hook(lambda m, a, o: _close(calls, m, len(tape.factors))))
    try:
        with tape.recording(), replay.record(), torch.no_grad():
            out, mid = step(h)
    finally:
        for handle in handles:
            handle.remove()
    names = [c.name for c in calls]
    if family.mid_residual not in names:
        raise NotAPiece(f"the mid residual child {family.mid_residual!r} was not called")
    split = names.index(family.mid_residual)
    record = LayerRecord(family, (calls[:split], calls[split:]), tape.factors, [p[0] for _, p in replay.records])
    if family.affine:  # out = L h + c: the pieces are L
        c_out, c_mid, neurons = layer_offsets(step, tape.factors[start:], h, _down_module(calls[split:], family,
                                                                                          tape.factors))
        out, mid = out - c_out, mid - c_mid
        record.offsets = Offsets(c_out, c_mid, neurons)
    if family.post_norm:  # read from the layer's module tree, which is only linearized now
        record.fixed = post_norm_pieces(record)
    return record, out, mid


def _down_module(calls: list[Call], family: Any, factors: list[Any]) -> nn.Module | None:
    """The down projection of the MLP among a branch's ``calls`` (its input is the neurons), or None where the branch
    holds no MLP known as one."""
    for call in calls:
        module = call.module
        if isinstance(module, DetachedGatedMLP):
            return getattr(module.inner, module.rule.down)
        if type(module) in family.containers and call.end == call.first + 1:
            try:
                return ungated_projections(module, call.children, factors[call.first].shape[-1], family.affine)[1]
            except NotAPiece:
                return None
    return None


def _close(calls: list[Call], module: nn.Module, count: int) -> None:
    for c in reversed(calls):
        if c.module is module and c.end is None:
            c.end = count
            return


def _branch(calls: list[Call], family: Any, factors: list[Any], probs: list[torch.Tensor]
            ) -> tuple[Any, list[tuple[NormPiece, bool]]]:
    """One residual branch's calls (norms* core norms*) as one core and its norms (each with whether it comes before
    the core), to be folded in by :func:`_fold`."""
    core: Any = None
    norms: list[tuple[NormPiece, bool]] = []  # (norm, before the core)
    for call in calls:
        module = call.module
        if isinstance(module, nn.Dropout | nn.Identity) and not module.training:
            continue
        try:
            if isinstance(module, DetachedNorm) and call.end == call.first + 1:
                norms.append((norm_piece(module, factors[call.first].reshape(-1)), core is None))
                continue
            if core is not None:
                raise NotAPiece(f"a second core ({type(module).__name__}) in one residual branch")
            core = _core(module, call.children, family, factors[call.first:call.end], probs)
        except NotAPiece as e:
            raise NotAPiece(f"{call.name}: {e}") from None
    if core is None:
        raise NotAPiece("a residual branch without an attention or MLP")
    return core, norms


def _fold(core: Any, norms: list[tuple[NormPiece, bool]], own: bool) -> None:
    """Fold a branch's norms into its core (into its weights in place where ``own`` and the core can)."""
    if own and hasattr(core, "owned"):
        core.owned = True
    for norm, _ in reversed([nb for nb in norms if nb[1]]):  # the one nearest the core first: W g C
        core.fold(norm.scale, norm.gain, True)
        if norm.center:
            centre(core, True)
    for norm, _ in (nb for nb in norms if not nb[1]):  # likewise after it: g C W
        if norm.center:
            centre(core, False)
        core.fold(norm.scale, norm.gain, False)


def _core(module: nn.Module, children: list[nn.Module], family: Any, factors: list[Any], probs: list[torch.Tensor]
          ) -> Any:
    """A branch's core from the module called and the factors it froze: a gated MLP, a mixture of experts, an
    attention block or an ungated MLP container; raises :class:`~detjac.engine.pieces.NotAPiece` (why) where it is
    not a known piece."""
    if isinstance(module, DetachedGatedMLP) and module.detach and len(factors) == 1:
        return _mlp(module, factors[0], family.affine)
    if isinstance(module, DetachedMoE):
        return moe_piece(module, factors)
    if type(module) in family.attentions:
        return _attention(module, probs.pop(0) if probs else None, family.affine)
    if type(module) in family.containers and len(factors) == 1:
        return ungated_mlp(module, children, factors[0], family.affine, Mlp)
    raise NotAPiece(f"{type(module).__name__} is not a known piece")


def _mlp(module: DetachedGatedMLP, factor: torch.Tensor, affine: bool) -> Mlp:
    """The MLP's linear path: through ``up`` with ``act(gate(x))`` frozen (convention ``up``), or through ``gate``
    with ``up(x) * act(g) / g`` frozen (convention ``gate``); either way one projection, the frozen factor, ``down``."""
    rule, inner = module.rule, module.inner
    through_gate = getattr(module, "convention", "up") == "gate"
    down_module = getattr(inner, rule.down)
    linear_module = getattr(inner, rule.gate_up if rule.fused else rule.gate if through_gate else rule.up)
    linear = projection(linear_module, affine)  # the linear path's problem is the one told, where both have one
    down = projection(down_module, affine)
    if rule.fused:  # chunked into (gate, up): gate is the first half of the rows, up the second
        half = linear.shape[0] // 2
        linear = linear[:half] if through_gate else linear[half:]
    return Mlp(linear, down, factor.reshape(-1, factor.shape[-1]))


def _attention(module: nn.Module, probs: torch.Tensor | None, affine: bool) -> Attention:
    if probs is None:
        raise NotAPiece("no frozen attention probabilities were recorded")
    cfg = module.config
    heads = int(cfg.num_attention_heads)
    kvh = heads // int(getattr(module, "num_key_value_groups", 1))  # as the detached attention reads it
    hd = int(module.head_dim)
    value, out = attention_weights(module, heads, kvh, hd, affine)
    if value.shape[0] != kvh * hd or out.shape[1] != heads * hd or probs.shape[0] != heads:
        raise NotAPiece(f"{type(module).__name__}: head shapes that do not match the config")
    return Attention(value, out, probs, kvh, hd)
