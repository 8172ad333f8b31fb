"""A detached layer's run recorded, and read as pieces (:mod:`detjac.engine.pieces.layer`) from the family declaration.

:func:`record_layer` runs a layer once with hooks on its children (a :class:`LayerRecord`); :meth:`LayerRecord.pieces`
reads each residual branch as one core recognised by kind, or says why it cannot. Details: docs/engine.md, "Piece
kinds"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..detach.factors import FactorTape
from ..detach.moe import DetachedMoE
from ..detach.wrappers import AttentionReplay, DetachedGatedMLP, DetachedNorm
from .affine import attention_weights, centre, layer_offsets, projection, ungated_mlp
from .experts import moe_piece
from .layer import Attention, LayerPieces, Mlp, NormPiece, norm_piece
from .postnorm import post_norm_pieces


@dataclass
class LayerRecord:
    """What one run of a detached layer froze: its children's calls ([name, module, first factor, end, the module's
    children as they were, wrapped]) on either
    side of the mid residual, indexing ``factors`` (the tape's), and each attention call's probabilities."""

    family: Any
    branches: tuple[list[list[Any]], list[list[Any]]]
    factors: list[Any]
    probs: list[torch.Tensor]  # (heads, n, n) per attention call, in call order
    fixed: LayerPieces | None = None  # pieces that fold nothing (post-norm layers), built once while recording

    def pieces(self) -> LayerPieces | str:
        """The layer's pieces, norms folded in (new tensors each time: nothing is kept between sweeps)."""
        if self.fixed is not None:
            return self.fixed
        probs = list(self.probs)
        cores = [_branch(part, self.family, self.factors, probs) for part in self.branches]
        problem = next((c for c in cores if isinstance(c, str)), None)
        return problem if problem is not None else LayerPieces(*cores)


def record_layer(layer: nn.Module, family: Any, step: Any, h: torch.Tensor, tape: FactorTape | None = None
                 ) -> tuple[LayerRecord | str, torch.Tensor, torch.Tensor]:
    """Run ``step`` (the detached layer, (n, d) -> (out, mid)) on ``h`` once, recording every child's frozen
    factors (into ``tape``, default a new one); return the record (or why the layer is not made of a known
    structure) and the linear part of the layer's (out, mid): less the offsets of an affine family's layer."""
    calls: list[list[Any]] = []  # [name, module, factor count before, after, its children then (linearized)]
    tape, replay = tape if tape is not None else FactorTape(), AttentionReplay()
    start = len(tape.factors)
    handles = []
    for name, child in layer.named_children():
        handles.append(child.register_forward_pre_hook(
            lambda m, a, name=name: calls.append([name, m, len(tape.factors), None, list(m.children())])))
        handles.append(child.register_forward_hook(lambda m, a, o: _close(calls, m, len(tape.factors))))
    try:
        with tape.recording(), replay.record(), torch.no_grad():
            out, mid = step(h)
    finally:
        for handle in handles:
            handle.remove()
    if family.affine:  # out = L h + c: the pieces are L
        c_out, c_mid = layer_offsets(step, tape.factors[start:], h)
        out, mid = out - c_out, mid - c_mid
    names = [c[0] for c in calls]
    if family.mid_residual not in names:
        return f"the mid residual child {family.mid_residual!r} was not called", out, mid
    split = names.index(family.mid_residual)
    record = LayerRecord(family, (calls[:split], calls[split:]), tape.factors, [p[0] for _, p in replay.records])
    if family.post_norm:  # read from the layer's module tree, which is only linearized now
        fixed = post_norm_pieces(record)
        if isinstance(fixed, str):
            return fixed, out, mid
        record.fixed = fixed
    return record, out, mid


def layer_pieces(layer: nn.Module, family: Any, step: Any, h: torch.Tensor
                 ) -> tuple[LayerPieces | str, torch.Tensor, torch.Tensor]:
    """:func:`record_layer`, then the record's pieces (or why the layer has an unknown piece)."""
    record, out, mid = record_layer(layer, family, step, h)
    return (record if isinstance(record, str) else record.pieces()), out, mid


def _close(calls: list[list[Any]], module: nn.Module, count: int) -> None:
    for c in reversed(calls):
        if c[1] is module and c[3] is None:
            c[3] = count
            return


def _branch(calls: list[list[Any]], family: Any, factors: list[Any], probs: list[torch.Tensor]) -> Any:
    """One residual branch's calls (norms* core norms*) as one core with its norms folded in."""
    core: Any = None
    norms: list[tuple[NormPiece, bool]] = []  # (norm, before the core)
    for name, module, f0, f1, children in calls:
        if isinstance(module, nn.Dropout | nn.Identity) and not module.training:
            continue
        if isinstance(module, DetachedNorm) and f1 == f0 + 1:
            norm = norm_piece(module, factors[f0].reshape(-1))
            if isinstance(norm, str):
                return f"{name}: {norm}"
            norms.append((norm, core is None))
            continue
        if core is not None:
            return f"{name}: a second core ({type(module).__name__}) in one residual branch"
        core = _core(module, children, family, factors[f0:f1], probs)
        if isinstance(core, str):
            return f"{name}: {core}"
    if core is None:
        return "a residual branch without an attention or MLP"
    for norm, _ in reversed([nb for nb in norms if nb[1]]):  # the one nearest the core first: W g C
        core.fold(norm.scale, norm.gain, True)
        if norm.center:
            centre(core, True)
    for norm, _ in (nb for nb in norms if not nb[1]):  # likewise after it: g C W
        if norm.center:
            centre(core, False)
        core.fold(norm.scale, norm.gain, False)
    return core


def _core(module: nn.Module, children: list[nn.Module], family: Any, factors: list[Any], probs: list[torch.Tensor]
          ) -> Any:
    """A branch's core from the module called and the factors it froze: a gated MLP, a mixture of experts, an
    attention block or an ungated MLP container; or why it is not a known piece."""
    if isinstance(module, DetachedGatedMLP) and module.detach and len(factors) == 1:
        return _mlp(module, factors[0], family.affine)
    if isinstance(module, DetachedMoE):
        return moe_piece(module, factors)
    if type(module) in family.attentions:
        return _attention(module, probs.pop(0) if probs else None, family.affine)
    if type(module) in family.containers and len(factors) == 1:
        return ungated_mlp(module, children, factors[0], family.affine, Mlp)
    return f"{type(module).__name__} is not a known piece"


def _mlp(module: DetachedGatedMLP, factor: torch.Tensor, affine: bool) -> Mlp | str:
    """The MLP's linear path: through ``up`` with ``act(gate(x))`` frozen (convention ``up``), or through ``gate``
    with ``up(x) * act(g) / g`` frozen (convention ``gate``); either way one projection, the frozen factor, ``down``."""
    rule, inner = module.rule, module.inner
    through_gate = getattr(module, "convention", "up") == "gate"
    down = projection(getattr(inner, rule.down), affine)
    linear = projection(getattr(inner, rule.gate_up if rule.fused else rule.gate if through_gate else rule.up), affine)
    if isinstance(linear, str) or isinstance(down, str):
        return linear if isinstance(linear, str) else down  # type: ignore[return-value]
    if rule.fused:  # chunked into (gate, up): gate is the first half of the rows, up the second
        half = linear.shape[0] // 2
        linear = linear[:half] if through_gate else linear[half:]
    return Mlp(linear, down, factor.reshape(-1, factor.shape[-1]))


def _attention(module: nn.Module, probs: torch.Tensor | None, affine: bool) -> Attention | str:
    if probs is None:
        return "no frozen attention probabilities were recorded"
    cfg = module.config
    heads = int(cfg.num_attention_heads)
    kvh = heads // int(getattr(module, "num_key_value_groups", 1))  # as the detached attention reads it
    hd = int(module.head_dim)
    value, out = attention_weights(module, heads, kvh, hd, affine)
    if isinstance(value, str) or isinstance(out, str):
        return value if isinstance(value, str) else out  # type: ignore[return-value]
    if value.shape[0] != kvh * hd or out.shape[1] != heads * hd or probs.shape[0] != heads:
        return f"{type(module).__name__}: head shapes that do not match the config"
    return Attention(value, out, probs, kvh, hd)
