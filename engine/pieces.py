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
transpose to a block of vectors laid out as one matrix (block · positions × d) is two GEMMs, each
core's result added to the residual inside the last one (:func:`plus`, ``addmm``):

- the MLP's intermediate (width ffn) is made a few rows at a time (:class:`GatedRows`, 8 MiB on a
  CPU), the gate multiplied in place while the chunk is in cache, so it is never held for the block;
- attention computes the values (or the output projection's cotangents) transposed,
  ``(heads · hd, block · positions)``: per head that is a plain ``(hd · block, positions)`` matrix, so
  the product with ``P_hᵀ`` (``P_h`` going down) is one GEMM per query head, summed into its
  key-value head's buffer in place, and the result feeds the next projection as a transposed view:
  no layout copies, and ``P`` is never expanded over the block.

Anything else is an unknown piece: :func:`layer_pieces` returns why, and the caller falls back to
``torch.func``.

Scope of exactness: the pieces are the same frozen factors the autograd sweeps use (recorded from
the same forward pass through :func:`~detjac.engine.tape.freeze` and the attention replay), so the
two agree to rounding; :func:`check_layer` also checks that the pieces rebuild the layer's own
output from its input before a layer's pieces are trusted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .detach import AttentionReplay, DetachedGatedMLP, DetachedNorm
from .tape import FactorTape

# a gated MLP's intermediate (width ffn) is made this many bytes at a time (other devices: OTHER_CHUNK_BYTES), but at
# least MIN_CHUNK_ROWS rows (GEMMs with fewer rows run slower); on a CPU 8 MiB stays in cache between its two GEMMs
CHUNK_BYTES = {"cpu": 8 * 2**20}
OTHER_CHUNK_BYTES = 256 * 2**20
MIN_CHUNK_ROWS = 256


class GatedRows:
    """The rows ``(x W) ⊙ gate`` (B · m, ffn) of a gated MLP, made a few rows at a time into one reused buffer, so
    that the intermediate of width ffn is never held for the whole block (:func:`plus` adds each chunk's product)."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor) -> None:
        self.x, self.weight, self.gate = x, weight, gate  # (B, m, d), (d, ffn), (m, ffn)
        ffn = weight.shape[1]
        self.rows = max(MIN_CHUNK_ROWS, CHUNK_BYTES.get(x.device.type, OTHER_CHUNK_BYTES) // (ffn * x.element_size()))

    def chunks(self) -> Iterator[tuple[int, int, int, int, torch.Tensor]]:
        """(b0, b1, p0, p1, rows (b1 - b0) · (p1 - p0) × ffn): whole vectors b0:b1, or positions p0:p1 of one."""
        b, m, d = self.x.shape
        k = self.rows // m  # whole vectors per chunk (0: positions of one vector at a time)
        buf = self.x.new_empty(min(b * m, k * m if k else self.rows), self.weight.shape[1])
        spans = ([(b0, min(b, b0 + k), 0, m) for b0 in range(0, b, k)] if k
                 else [(b0, b0 + 1, p0, min(m, p0 + self.rows)) for b0 in range(b) for p0 in range(0, m, self.rows)])
        for b0, b1, p0, p1 in spans:
            z = torch.mm(self.x[b0:b1, p0:p1].reshape(-1, d), self.weight, out=buf[:(b1 - b0) * (p1 - p0)])
            z.view(b1 - b0, p1 - p0, -1).mul_(self.gate[p0:p1])
            yield b0, b1, p0, p1, z

    def full(self) -> torch.Tensor:
        """All rows at once (B · m, ffn)."""
        b, m, d = self.x.shape
        return (self.x.reshape(b * m, d) @ self.weight).view(b, m, -1).mul_(self.gate).view(b * m, -1)


Product = tuple[torch.Tensor | GatedRows, torch.Tensor, int]  # (lhs, rhs, s): a core's result lhs @ rhs, positions s:


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
        return GatedRows(x, self.up.T, self.gate[s:]), self.down.T, s

    def pull(self, g: torch.Tensor, s: int) -> Product:  # (B, n - s, d) -> (B, n - s, d)
        return GatedRows(g, self.down, self.gate[s:]), self.up, s


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
        heads, hd = self.probs.shape[0], self.head_dim
        r = heads // self.kv_heads
        # values transposed, (kv_heads · hd, c · m): each head's block is a plain (hd · c, m) matrix, rows (dim, vector)
        vt = (self.value @ x.reshape(c * m, d).T).view(self.kv_heads, hd * c, m)
        ot = vt.new_empty(heads, hd * c, m)  # each head's output transposed: (V P_h^T) in rows (dim, vector)
        for h in range(heads):
            torch.mm(vt[h // r], self.probs[h, s:, s:].T, out=ot[h])
        return ot.view(heads * hd, c * m).T, self.out.T, s  # (c · m, heads · hd) as a transposed view: no copy

    def pull(self, g: torch.Tensor, s: int) -> Product:  # (B, n - s, d) -> (B, n - s_in, d)
        b, m, d = g.shape
        heads, n, hd = self.probs.shape[0], self.probs.shape[-1], self.head_dim
        r = heads // self.kv_heads
        rows = self.probs[:, s:]  # (heads, m, n): the queries that carry cotangents
        used = rows.ne(0).any(dim=1).any(dim=0).nonzero()  # keys any of them reads (below a window: a band)
        s_in = int(used[0]) if used.numel() else n
        # the output projection's cotangents transposed, (heads · hd, B · m): per head a (hd · B, m) matrix
        got = (self.out.T @ g.reshape(b * m, d).T).view(heads, hd * b, m)
        gvt = got.new_empty(self.kv_heads, hd * b, n - s_in)  # per key-value head, summed over its query heads
        for h in range(heads):
            if h % r == 0:
                torch.mm(got[h], rows[h, :, s_in:], out=gvt[h // r])
            else:
                gvt[h // r].addmm_(got[h], rows[h, :, s_in:])
        return gvt.view(self.kv_heads * hd, b * (n - s_in)).T, self.value, s_in  # (B · (n - s_in), kv · hd), no copy


Core = Mlp | Attention


def plus(acc: torch.Tensor, sa: int, product: Product, own: bool = False) -> tuple[torch.Tensor, int]:
    """``acc`` (B, n - sa, d), positions sa:, plus a core's result ``lhs @ rhs`` (B · (n - s), d), positions s:,
    as positions min(sa, s):, the sum done by the GEMM itself (``addmm``); ``own``: ``acc`` may be added into.
    ``lhs`` may be :class:`GatedRows` (made and added a chunk at a time)."""
    lhs, rhs, s = product
    b, m, d = acc.shape
    if isinstance(lhs, GatedRows):
        if s == sa:
            return _plus_chunks(acc, lhs, rhs, own), sa
        lhs = lhs.full()
    if s == sa:
        if own and acc.is_contiguous():
            acc.view(b * m, d).addmm_(lhs, rhs)
            return acc, sa
        return torch.addmm(acc.reshape(b * m, d), lhs, rhs).view(b, m, d), sa
    if s < sa:  # the core reaches earlier positions (attention): the sum covers them
        out = torch.mm(lhs, rhs).view(b, m + sa - s, d)
        out[:, sa - s:] += acc
        return out, s
    out = acc if own else acc.clone()
    out[:, s - sa:] += (lhs @ rhs).view(b, -1, d)
    return out, sa


def _plus_chunks(acc: torch.Tensor, lhs: GatedRows, rhs: torch.Tensor, own: bool) -> torch.Tensor:
    """``acc`` (B, m, d) plus ``lhs @ rhs``, one chunk of rows at a time, each sum inside its GEMM."""
    into = own and acc.is_contiguous()
    out = acc if into else torch.empty(acc.shape, dtype=acc.dtype, device=acc.device)
    d = acc.shape[-1]
    for b0, b1, p0, p1, z in lhs.chunks():
        dst = out[b0:b1, p0:p1].view(-1, d)  # a view: whole vectors, or positions of one vector
        if into:
            dst.addmm_(z, rhs)
        else:
            torch.addmm(acc[b0:b1, p0:p1].reshape(-1, d), z, rhs, out=dst)
    return out


@dataclass
class LayerPieces:
    """A decoder layer as ``mid = h + first(h)``, ``out = mid + second(mid)``."""

    first: Core
    second: Core


@dataclass
class NormPiece:
    """A frozen norm: per-position scale (n,) and gain (d,) or None (no weight)."""

    scale: torch.Tensor
    gain: torch.Tensor | None

    def apply(self, x: torch.Tensor) -> torch.Tensor:  # (..., n, d) -> same
        y = x * self.scale[:, None]
        return y * self.gain if self.gain is not None else y


def norm_piece(norm: nn.Module, scale: torch.Tensor) -> NormPiece | str:
    """A detached RMS norm with its frozen scale (n,) as a :class:`NormPiece`, or why it is not a known piece."""
    if not isinstance(norm, DetachedNorm) or norm.center or not norm.detach:
        return f"{type(norm).__name__} is not a detached RMS norm"
    weight = getattr(norm.inner, "weight", None)
    if weight is None:  # output norm(x) * offset, or norm(x)
        return NormPiece(scale * norm.offset if norm.offset else scale, None)
    weight = weight.to(scale.dtype)
    return NormPiece(scale, weight + norm.offset if norm.offset else weight)


def frozen_norm(norm: nn.Module, x: torch.Tensor) -> NormPiece | str:
    """The norm ``norm`` at ``x`` (n, d) as a :class:`NormPiece`, or why it is not a known piece."""
    if not isinstance(norm, DetachedNorm):
        return f"{type(norm).__name__} is not a detached RMS norm"
    tape = FactorTape()
    with tape.recording(), torch.no_grad():
        norm(x)
    return norm_piece(norm, tape.factors[0].reshape(-1))


def layer_pieces(layer: nn.Module, family: Any, step: Any, h: torch.Tensor
                 ) -> tuple[LayerPieces | str, torch.Tensor, torch.Tensor]:
    """Run ``step`` (the detached layer, (n, d) -> (out, mid)) on ``h`` once, recording every child's frozen
    factors; return the layer's pieces (or why it has an unknown piece) and the layer's (out, mid)."""
    calls: list[list[Any]] = []  # [name, module, factor count before, after]
    tape, replay = FactorTape(), AttentionReplay()
    handles = []
    for name, child in layer.named_children():
        handles.append(child.register_forward_pre_hook(
            lambda m, a, name=name: calls.append([name, m, len(tape.factors), None])))
        handles.append(child.register_forward_hook(lambda m, a, o: _close(calls, m, len(tape.factors))))
    try:
        with tape.recording(), replay.record(), torch.no_grad():
            out, mid = step(h)
    finally:
        for handle in handles:
            handle.remove()
    names = [c[0] for c in calls]
    if family.mid_residual not in names:
        return f"the mid residual child {family.mid_residual!r} was not called", out, mid
    split = names.index(family.mid_residual)
    probs = [p[0] for _, p in replay.records]  # (heads, n, n) per attention call, in call order
    branches = []
    for part in (calls[:split], calls[split:]):
        core = _branch(part, family, tape.factors, probs)
        if isinstance(core, str):
            return core, out, mid
        branches.append(core)
    return LayerPieces(*branches), out, mid


def _close(calls: list[list[Any]], module: nn.Module, count: int) -> None:
    for c in reversed(calls):
        if c[1] is module and c[3] is None:
            c[3] = count
            return


def _branch(calls: list[list[Any]], family: Any, factors: list[Any], probs: list[torch.Tensor]) -> Core | str:
    """One residual branch's calls (norms* core norms*) as one core with its norms folded in."""
    core: Core | None = None
    norms: list[tuple[NormPiece, bool]] = []  # (norm, before the core)
    for name, module, f0, f1 in calls:
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
        if isinstance(module, DetachedGatedMLP) and module.detach and f1 == f0 + 1:
            core = _mlp(module, factors[f0])
        elif type(module) in family.attentions:
            core = _attention(module, probs.pop(0) if probs else None)
        else:
            return f"{name}: {type(module).__name__} is not a known piece"
        if isinstance(core, str):
            return f"{name}: {core}"
    if core is None:
        return "a residual branch without an attention or MLP"
    for norm, before in norms:
        core.fold(norm.scale, norm.gain, before)
    return core


def _weight(module: Any) -> torch.Tensor | str:
    if not isinstance(module, nn.Linear) or module.bias is not None:
        return f"{type(module).__name__} is not a bias-free nn.Linear"
    return module.weight


def _mlp(module: DetachedGatedMLP, factor: torch.Tensor) -> Mlp | str:
    """The MLP's linear path: through ``up`` with ``act(gate(x))`` frozen (convention ``up``), or through ``gate``
    with ``up(x) * act(g) / g`` frozen (convention ``gate``); either way one projection, the frozen factor, ``down``."""
    rule, inner = module.rule, module.inner
    through_gate = getattr(module, "convention", "up") == "gate"
    down = _weight(getattr(inner, rule.down))
    linear = _weight(getattr(inner, rule.gate_up if rule.fused else rule.gate if through_gate else rule.up))
    if isinstance(linear, str) or isinstance(down, str):
        return linear if isinstance(linear, str) else down  # type: ignore[return-value]
    if rule.fused:  # chunked into (gate, up): gate is the first half of the rows, up the second
        half = linear.shape[0] // 2
        linear = linear[:half] if through_gate else linear[half:]
    return Mlp(linear, down, factor.reshape(-1, factor.shape[-1]))


def _attention(module: nn.Module, probs: torch.Tensor | None) -> Attention | str:
    if probs is None:
        return "no frozen attention probabilities were recorded"
    cfg = module.config
    heads = int(cfg.num_attention_heads)
    kvh = int(getattr(cfg, "num_key_value_heads", None) or heads)
    hd = int(module.head_dim)
    out = _weight(getattr(module, "o_proj", None))
    if hasattr(module, "v_proj"):
        value = _weight(module.v_proj)
    elif hasattr(module, "qkv_proj"):  # fused [q | k | v] (Phi3)
        value = _weight(module.qkv_proj)
        if not isinstance(value, str):
            value = value[(heads + kvh) * hd:]
    else:
        return f"{type(module).__name__} has neither v_proj nor qkv_proj"
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
        mid_hat = plus(h[None], 0, pieces.first.push(h[None], 0))[0][0]
        out_hat = plus(mid_hat[None], 0, pieces.second.push(mid_hat[None], 0))[0][0]
    for name, got, want in (("mid residual", mid_hat, mid), ("output", out_hat, out)):
        err = float((got - want).norm() / want.norm().clamp_min(torch.finfo(want.dtype).tiny))
        if not err <= bound:
            return f"its pieces rebuild the layer's {name} with relative error {err:.1e} (bound {bound:g})"
    return None
