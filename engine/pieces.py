"""A detached decoder layer as explicit linear pieces, for the explicit sweeps (:mod:`detjac.engine.adjoint`).

Once its factors are frozen, a decoder layer is ``mid = h + A(h)``, ``out = mid + M(mid)``, and each
residual branch is a chain of a few kinds of pieces, read from the family declaration's wrappers:

- a norm (:class:`~detjac.engine.detach.DetachedNorm`, RMS, not centred): a diagonal, its frozen
  per-position scale ``s`` (n,) times its gain ``g = offset + w`` (d,);
- a gated MLP (:class:`~detjac.engine.detach.DetachedGatedMLP`, plain or fused): ``W_down (a ⊙ W_up x)``
  with the frozen gate ``a = act(gate(x))`` (n, ffn), or, in the ``gate`` convention,
  ``W_down (a ⊙ W_gate x)`` with ``a = up(x) act(g) / g`` frozen;
- an attention block of the family's declared classes: ``W_o [P_h V_kv(h)]_h`` with ``V = x W_v^T``
  and the frozen probabilities ``P`` (heads, n, n), grouped over shared key-value heads;
- a dropout in eval mode: the identity.

Each branch must be ``norms* core norms*`` with one MLP or attention core; the norms' diagonals are
folded into the core once per layer (gains into the projection weights' columns or rows, the
per-position scales into the gate or into ``P``'s columns or rows), so applying the branch or its
transpose to a block of vectors laid out as one matrix (block · positions × d) is two or three
GEMMs, plus, for attention, one batched product with ``P`` (or ``Pᵀ``) per key-value group, never
expanded over the block. Anything else is an unknown piece: :func:`layer_pieces` returns why, and
the caller falls back to ``torch.func``.

Scope of exactness: the pieces are the same frozen factors the autograd sweeps use (recorded from
the same forward pass through :func:`~detjac.engine.tape.freeze` and the attention replay), so the
two agree to rounding; :func:`check_layer` also checks that the pieces rebuild the layer's own
output from its input before a layer's pieces are trusted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .detach import AttentionReplay, DetachedGatedMLP, DetachedNorm
from .moe import DetachedMoE
from .pieces_affine import attention_weights, centre, layer_offsets, projection, ungated_mlp
from .pieces_moe import moe_piece
from .tape import FactorTape

Product = tuple[torch.Tensor, torch.Tensor, int]  # (lhs, rhs, s): a core's result lhs @ rhs, positions s: on


@dataclass
class Mlp:
    """``y = W_down (gate ⊙ (x W_up^T))`` per position; norms folded in."""

    up: torch.Tensor  # (ffn, d)
    down: torch.Tensor  # (d, ffn)
    gate: torch.Tensor  # (n, ffn)

    mixes = False  # position-wise: rows s: in, rows s: out

    def fold(self, scale: torch.Tensor, gain: torch.Tensor | None, before: bool) -> None:
        self.gate = self.gate * scale[:, None]
        if gain is not None:
            if before:
                self.up = self.up * gain[None, :]
            else:
                self.down = gain[:, None] * self.down

    def push(self, x: torch.Tensor, s: int) -> Product:  # (c, n - s, d) -> (c, n - s, d)
        c, m, d = x.shape
        u = (x.reshape(c * m, d) @ self.up.T).view(c, m, -1).mul_(self.gate[s:])
        return u.view(c * m, -1), self.down.T, s

    def pull(self, g: torch.Tensor, s: int) -> Product:  # (B, n - s, d) -> (B, n - s, d)
        b, m, d = g.shape
        z = (g.reshape(b * m, d) @ self.down).view(b, m, -1).mul_(self.gate[s:])
        return z.view(b * m, -1), self.up, s


@dataclass
class Attention:
    """``y = W_o [P_h V_{kv(h)}]_h`` with ``V = x W_v^T``; query heads ``kv * r .. kv * r + r - 1`` share
    key-value head ``kv``. Norms folded in (scales into ``P``'s columns before, rows after)."""

    value: torch.Tensor  # (kv_heads * hd, d)
    out: torch.Tensor  # (d, heads * hd)
    probs: torch.Tensor  # (heads, n, n)
    kv_heads: int
    head_dim: int

    mixes = True

    def fold(self, scale: torch.Tensor, gain: torch.Tensor | None, before: bool) -> None:
        if before:
            self.probs = self.probs * scale[None, None, :]
            if gain is not None:
                self.value = self.value * gain[None, :]
        else:
            self.probs = self.probs * scale[None, :, None]
            if gain is not None:
                self.out = gain[:, None] * self.out

    def causal_from(self, s: int) -> bool:
        """Whether no position before ``s`` reads a position from ``s`` on (then vectors zero before ``s`` stay so)."""
        return s == 0 or not self.probs[:, :s, s:].any()

    def push(self, x: torch.Tensor, s: int) -> Product:  # (c, n - s, d) -> (c, n - s, d); causal_from(s)
        c, m, d = x.shape
        kvh, hd = self.kv_heads, self.head_dim
        r = self.probs.shape[0] // kvh
        v = (x.reshape(c * m, d) @ self.value.T).view(c, m, kvh, hd).permute(2, 1, 0, 3).reshape(kvh, m, c * hd)
        p = self.probs[:, s:, s:].reshape(kvh, r * m, m)
        o = torch.matmul(p, v).view(kvh, r, m, c, hd).permute(3, 2, 0, 1, 4).reshape(c * m, kvh * r * hd)
        return o, self.out.T, s

    def pull(self, g: torch.Tensor, s: int) -> Product:  # (B, n - s, d) -> (B, n - s_in, d)
        b, m, d = g.shape
        kvh, hd = self.kv_heads, self.head_dim
        heads, n = self.probs.shape[0], self.probs.shape[-1]
        r = heads // kvh
        rows = self.probs[:, s:]  # (heads, m, n): the queries that carry cotangents
        used = rows.ne(0).any(dim=1).any(dim=0).nonzero()  # keys any of them reads (below a window: a band)
        s_in = int(used[0]) if used.numel() else n
        rows = rows[:, :, s_in:].reshape(kvh, r * m, n - s_in)
        go = (g.reshape(b * m, d) @ self.out).view(b, m, kvh, r, hd).permute(2, 3, 1, 0, 4).reshape(kvh, r * m, b * hd)
        gv = torch.matmul(rows.mT, go)  # (kv_heads, n - s_in, B * hd): P^T summed over each group inside the GEMM
        gv = gv.view(kvh, n - s_in, b, hd).permute(2, 1, 0, 3).reshape(b * (n - s_in), kvh * hd)
        return gv, self.value, s_in


Core = Mlp | Attention


def plus(acc: torch.Tensor, sa: int, product: Product, own: bool = False) -> tuple[torch.Tensor, int]:
    """``acc`` (B, n - sa, d), positions sa:, plus a core's result ``lhs @ rhs`` (B · (n - s), d), positions s:,
    as positions min(sa, s):, the sum done by the GEMM itself (``addmm``); ``own``: ``acc`` may be added into."""
    lhs, rhs, s = product
    b, m, d = acc.shape
    if s == sa:
        if own and acc.is_contiguous():
            acc.view(b * m, d).addmm_(lhs, rhs)
            return acc, sa
        return torch.addmm(acc.reshape(b * m, d), lhs, rhs).view(b, m, d), sa
    if s < sa:  # the core reaches earlier positions (attention): the sum covers them
        out = acc.new_zeros(b, m + sa - s, d)
        out[:, sa - s:] = acc
        out.view(-1, d).addmm_(lhs, rhs)
        return out, s
    out = acc if own else acc.clone()
    out[:, s - sa:] += (lhs @ rhs).view(b, -1, d)
    return out, sa


def cross(acc: torch.Tensor, sa: int, core: Any, x: torch.Tensor, s: int, up: bool, own: bool = False
          ) -> tuple[torch.Tensor, int]:
    """``acc`` (B, n - sa, d), positions sa:, plus ``core`` applied to ``x`` (positions s:), going up (``push``) or
    down (``pull``, its transpose). A core that adds its result itself (``push_into`` / ``pull_into``: a mixture of
    experts, whose experts read different positions) does; the others' one GEMM goes through :func:`plus`."""
    direct = getattr(core, "push_into" if up else "pull_into", None)
    if direct is not None:
        return direct(acc, sa, x, s, own)
    return plus(acc, sa, (core.push if up else core.pull)(x, s), own)


@dataclass
class LayerPieces:
    """A decoder layer as ``mid = h + first(h)``, ``out = mid + second(mid)``; in a post-norm layer (BERT) the
    residual sums go through norms: ``mid = N1(h + first(h))``, ``out = N2(mid + second(mid))``."""

    first: Core
    second: Core
    first_norm: NormPiece | None = None
    second_norm: NormPiece | None = None


def pull_layer(pieces: LayerPieces, g_out: torch.Tensor, g_mid: torch.Tensor | None, s: int
               ) -> tuple[torch.Tensor, int]:
    """Cotangents (B, n, d) at a layer's output and mid residual (None: zero), zero before position ``s`` (< n),
    -> (B, n, d) at its input, and the first position from which they may be nonzero."""
    n = g_out.shape[1]
    top = g_out[:, s:]
    if pieces.second_norm is not None:
        top = pieces.second_norm.transpose(top, s)
    gm, sm = cross(top, s, pieces.second, top, s, up=False)  # the residual passes the output's on
    if g_mid is not None:
        gm[:, s - sm:] += g_mid[:, s:]
    if pieces.first_norm is not None:
        gm = pieces.first_norm.transpose(gm, sm)
    gi, si = cross(gm, sm, pieces.first, gm, sm, up=False, own=True)
    if si == 0:
        return gi, 0
    full = gi.new_zeros(gi.shape[0], n, gi.shape[2])
    full[:, si:] = gi
    return full, si


def push_layer(pieces: LayerPieces, tangent: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tangents (c, n - s, d) at a layer's input (positions s:) -> (at its output, at its mid residual)."""
    t_mid = cross(tangent, s, pieces.first, tangent, s, up=True)[0]
    if pieces.first_norm is not None:
        t_mid = pieces.first_norm.apply(t_mid, s)
    t_out = cross(t_mid, s, pieces.second, t_mid, s, up=True)[0]
    return (pieces.second_norm.apply(t_out, s) if pieces.second_norm is not None else t_out), t_mid


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


def norm_piece(norm: nn.Module, scale: torch.Tensor) -> NormPiece | str:
    """A detached norm (RMS, or a centred LayerNorm) with its frozen scale (n,) as a :class:`NormPiece`, or why it
    is not a known piece."""
    if not isinstance(norm, DetachedNorm) or not norm.detach:
        return f"{type(norm).__name__} is not a detached norm"
    weight = getattr(norm.inner, "weight", None)
    if weight is None:  # output norm(x) * offset, or norm(x)
        return NormPiece(scale * norm.offset if norm.offset else scale, None, norm.center)
    weight = weight.to(scale.dtype)
    return NormPiece(scale, weight + norm.offset if norm.offset else weight, norm.center)


def frozen_norm(norm: nn.Module, x: torch.Tensor) -> NormPiece | str:
    """The norm ``norm`` at ``x`` (n, d) as a :class:`NormPiece`, or why it is not a known piece."""
    if not isinstance(norm, DetachedNorm):
        return f"{type(norm).__name__} is not a detached norm"
    tape = FactorTape()
    with tape.recording(), torch.no_grad():
        norm(x)
    return norm_piece(norm, tape.factors[0].reshape(-1))


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
        from .pieces_post import post_norm_pieces  # it builds on this module's pieces

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


def check_layer(pieces: LayerPieces, h: torch.Tensor, out: torch.Tensor, mid: torch.Tensor) -> str | None:
    """None if the pieces rebuild the layer's (out, mid) from its input ``h`` (n, d), else what differs.

    The bound is loose (1e-9 in float64, 1e-3 in float32, 5e-2 below): it catches a wrong wiring or an
    unfolded factor, whose errors are of order one; exactness itself is what the tests prove.
    """
    bound = {torch.float64: 1e-9, torch.float32: 1e-3}.get(h.dtype, 5e-2)
    with torch.no_grad():
        out_hat, mid_hat = (t[0] for t in push_layer(pieces, h[None], 0))
    for name, got, want in (("mid residual", mid_hat, mid), ("output", out_hat, out)):
        err = float((got - want).norm() / want.norm().clamp_min(torch.finfo(want.dtype).tiny))
        if not err <= bound:
            return f"its pieces rebuild the layer's {name} with relative error {err:.1e} (bound {bound:g})"
    return None
