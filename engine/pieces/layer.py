"""A detached decoder layer as explicit linear pieces, for the explicit sweeps (:mod:`detjac.engine.streamed.adjoint`,
:mod:`detjac.engine.inmemory.model_pieces`).

Norms are folded into one core per residual branch (a gated MLP, experts, attention), so a block of vectors crosses
the layer as a few GEMMs (:func:`push_layer`, :func:`pull_layer`), once :func:`check_layer` has passed. Derivation and
costs: docs/engine.md, "Explicit sweeps" and "Piece kinds"."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from detjac.exactness import pieces_bound

from . import NotAPiece
from .fold import fold_pays, plus_folded
from .lazy import wide
from .norms import NormPiece

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
    """``y = W_down (post ⊙ gate ⊙ (x W_up^T))`` per position; norms folded in.

    Its neurons are ``z = gate ⊙ (x W_up^T)`` (n, ffn): the frozen factor times the linear path, with the norms
    *before* the MLP folded in (``gate`` carries their scales, ``up`` their gains), so ``z`` is the neuron of the
    unfolded model; a norm *after* it is the write side's (``post`` (n,) its scales, ``down`` its gain)."""

    up: torch.Tensor  # (ffn, d)
    down: torch.Tensor  # (d, ffn)
    gate: torch.Tensor  # (n, ffn)
    post: torch.Tensor | None = None  # (n,) the scales of the norms after the MLP, None: none
    bias: torch.Tensor | None = None  # (n, ffn) an affine family's neurons on a zero MLP input (None: zero)
    neuron_bias: torch.Tensor | None = None  # (n, ffn) the neurons on a zero layer input: their layer's constants
    layer_bias: torch.Tensor | None = None  # (n, d) the layer's output on a zero input, the neurons held at zero
    owned: bool = False  # the weights are this piece's to change: gains are folded into them in place

    mixes = False  # position-wise: rows s: in, rows s: out

    def offsets(self, neurons: torch.Tensor, mid: torch.Tensor, out: torch.Tensor) -> None:
        """Set an affine layer's constants from its run on a zero input (:class:`~detjac.engine.pieces.record.
        Offsets`): the neurons' own (:attr:`bias`: their values less what they read of that run's mid residual),
        the neurons' in that run (:attr:`neuron_bias`) and the layer's output with its neurons held at zero
        (:attr:`layer_bias`: its output less what the neurons wrote)."""
        neurons = neurons.to(self.gate.dtype)
        self.bias, self.neuron_bias = neurons - self.gate * (mid @ wide(self.up).T), neurons
        self.layer_bias = out - self.output(neurons)

    def fold(self, scale: torch.Tensor, gain: torch.Tensor | None, before: bool) -> None:
        if before:
            self.gate = self.gate * scale[:, None]
        else:
            self.post = scale if self.post is None else self.post * scale
        if gain is not None:
            if before:
                self.up = _scaled(self.up, gain[None, :], self.owned)
            else:
                self.down = _scaled(self.down, gain[:, None], self.owned)

    @property
    def rows_gate(self) -> torch.Tensor:
        """(n, ffn) the factor a block's rows are multiplied by: the neurons' gate, then the scales after."""
        return self.gate if self.post is None else self.gate * self.post[:, None]

    def push(self, x: torch.Tensor, s: int) -> Product:  # (c, n - s, d) -> (c, n - s, d)
        return GatedRows(x, wide(self.up).T, self.rows_gate[s:]), wide(self.down).T, s

    def pull(self, g: torch.Tensor, s: int) -> Product:  # (B, n - s, d) -> (B, n - s, d)
        return GatedRows(g, wide(self.down), self.rows_gate[s:]), wide(self.up), s

    # -- the neurons (attribution graphs) ---------------------------------------------------

    @property
    def n_neurons(self) -> int:
        return int(self.up.shape[0])

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        """(n, d) the MLP's input (its mid residual, before the folded norm) -> (n, ffn) its neurons' values (with
        their :attr:`bias`, an affine family's)."""
        z = self.gate * (x @ wide(self.up).T)
        return z if self.bias is None else z + self.bias

    def neuron_cotangents(self, g: torch.Tensor) -> torch.Tensor:
        """(B, n, d) cotangents at the MLP's output -> (B, n, ffn) at its neurons (each neuron writes
        ``post_p · W_down[:, i]``)."""
        z = g @ wide(self.down)
        return z if self.post is None else z * self.post[:, None]

    def neuron_seeds(self, g: torch.Tensor) -> torch.Tensor:
        """(B, n, ffn) cotangents at the neurons -> (B, n, d) at the MLP's input (each neuron reads
        ``gate_{p,i} · W_up[i]``)."""
        return (g * self.gate) @ wide(self.up)

    def read_rows(self, pos: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """(m, d) what neurons ``idx`` at positions ``pos`` read from the MLP's input: ``gate_{p,i} W_up[i]``."""
        return self.gate[pos, idx, None] * wide(self.up)[idx]

    def write_rows(self, pos: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """(m, d) what neurons ``idx`` at positions ``pos`` write per unit of their value: ``post_p W_down[:, i]``."""
        w = wide(self.down)[:, idx].T
        return w if self.post is None else w * self.post[pos, None]

    def output(self, z: torch.Tensor) -> torch.Tensor:
        """(n, ffn) neuron values -> (n, d) the MLP's output."""
        return (z if self.post is None else z * self.post[:, None]) @ wide(self.down).T

    def write_vectors(self) -> torch.Tensor:
        """(ffn, d) what each neuron writes per unit of its value, before the scales of any norm after the MLP
        (positive per position: the direction is the same at every position); the neuron pages' logit effects."""
        return wide(self.down).T


@dataclass
class Attention:
    """``y = W_o [P_h V_{kv(h)}]_h`` with ``V = x W_v^T``; query heads ``kv * r .. kv * r + r - 1`` share
    key-value head ``kv``. Norms folded in (scales into ``P``'s columns before, rows after)."""

    value: torch.Tensor  # (kv_heads * hd, d)
    out: torch.Tensor  # (d, heads * hd)
    probs: torch.Tensor  # (heads, n, n)
    kv_heads: int
    head_dim: int
    owned: bool = False  # the weights are this piece's to change: gains are folded into them in place

    mixes = True

    def fold(self, scale: torch.Tensor, gain: torch.Tensor | None, before: bool) -> None:
        if before:
            self.probs = self.probs * scale[None, None, :]
            if gain is not None:
                self.value = _scaled(self.value, gain[None, :], self.owned)
        else:
            self.probs = self.probs * scale[None, :, None]
            if gain is not None:
                self.out = _scaled(self.out, gain[:, None], self.owned)

    # Head by head: head h's output is W_o,h P_h V_kv(h) x (norms folded in, so through the frozen norm after it); the
    # heads act in parallel, so y is exactly their sum. An affine family's value and output biases are constants,
    # outside these maps (the layer's bias node). Read by the graphs' head loadings and the QK components.
    def head_values(self, x: torch.Tensor) -> torch.Tensor:
        """(B, n, d) vectors at the layer's input -> (B, heads, n, hd) each head's mix of values ``P_h V_kv(h) x``."""
        b, n, _ = x.shape
        heads, hd, kvh = self.probs.shape[0], self.head_dim, self.kv_heads
        v = (x @ wide(self.value).T).view(b, n, kvh, hd).transpose(1, 2)  # (B, kv_heads, n, hd)
        return self.probs @ v.repeat_interleave(heads // kvh, dim=1)  # (heads, n, n) @ (B, heads, n, hd)

    def head_cotangents(self, g: torch.Tensor) -> torch.Tensor:
        """(B, n, d) cotangents at the attention's output -> (B, heads, n, hd) at each head's value mix
        (``g W_o,h``)."""
        b, n, _ = g.shape
        heads, hd = self.probs.shape[0], self.head_dim
        return (g @ wide(self.out)).view(b, n, heads, hd).transpose(1, 2)

    def heads_output(self, mixed: torch.Tensor) -> torch.Tensor:
        """(B, heads, n, hd) the heads' value mixes -> (B, n, d) the attention's output, their sum through ``W_o``."""
        b, heads, n, hd = mixed.shape
        return mixed.transpose(1, 2).reshape(b, n, heads * hd) @ wide(self.out).T

    def head_outputs(self, x: torch.Tensor) -> torch.Tensor:
        """(n, d) at the layer's input -> (heads, n, d) each head's output ``W_o,h P_h V_kv(h) x``."""
        heads, hd = self.probs.shape[0], self.head_dim
        out = wide(self.out)
        return torch.einsum("hnk,dhk->hnd", self.head_values(x[None])[0], out.view(out.shape[0], heads, hd))

    def causal_from(self, s: int) -> bool:
        """Whether no position before ``s`` reads a position from ``s`` on (then vectors zero before ``s`` stay so)."""
        return s == 0 or not self.probs[:, :s, s:].any()

    def push(self, x: torch.Tensor, s: int) -> Product:  # (c, n - s, d) -> (c, n - s, d); causal_from(s)
        c, m, d = x.shape
        heads, hd = self.probs.shape[0], self.head_dim
        r = heads // self.kv_heads
        # values transposed, (kv_heads · hd, c · m): each head's block is a plain (hd · c, m) matrix, rows (dim, vector)
        vt = (wide(self.value) @ x.reshape(c * m, d).T).view(self.kv_heads, hd * c, m)
        ot = vt.new_empty(heads, hd * c, m)  # each head's output transposed: (V P_h^T) in rows (dim, vector)
        for h in range(heads):
            torch.mm(vt[h // r], self.probs[h, s:, s:].T, out=ot[h])
        return ot.view(heads * hd, c * m).T, wide(self.out).T, s  # (c · m, heads · hd) as a transposed view: no copy

    def pull(self, g: torch.Tensor, s: int) -> Product:  # (B, n - s, d) -> (B, n - s_in, d)
        b, m, d = g.shape
        heads, n, hd = self.probs.shape[0], self.probs.shape[-1], self.head_dim
        r = heads // self.kv_heads
        rows = self.probs[:, s:]  # (heads, m, n): the queries that carry cotangents
        used = rows.ne(0).any(dim=1).any(dim=0).nonzero()  # keys any of them reads (below a window: a band)
        s_in = int(used[0]) if used.numel() else n
        # the output projection's cotangents transposed, (heads · hd, B · m): per head a (hd · B, m) matrix
        got = (wide(self.out).T @ g.reshape(b * m, d).T).view(heads, hd * b, m)
        gvt = got.new_empty(self.kv_heads, hd * b, n - s_in)  # per key-value head, summed over its query heads
        for h in range(heads):
            if h % r == 0:
                torch.mm(got[h], rows[h, :, s_in:], out=gvt[h // r])
            else:
                gvt[h // r].addmm_(got[h], rows[h, :, s_in:])
        return gvt.view(self.kv_heads * hd, b * (n - s_in)).T, wide(self.value), s_in  # (B · (n - s_in), kv · hd)


Core = Mlp | Attention


def _scaled(weight: torch.Tensor, gain: torch.Tensor, own: bool) -> torch.Tensor:
    """``weight * gain`` (broadcast): in place where the weight is the piece's own (no second copy of the layer); a
    :class:`~.lazy.LazyWeight` applies it each time it is widened."""
    if hasattr(weight, "scaled"):
        return weight.scaled(gain)
    return weight.mul_(gain) if own else weight * gain


def plus(acc: torch.Tensor, sa: int, product: Product, own: bool = False) -> tuple[torch.Tensor, int]:
    """``acc`` (B, n - sa, d), positions sa:, plus a core's result ``lhs @ rhs`` (B · (n - s), d), positions s:,
    as positions min(sa, s):, the sum done by the GEMM itself (``addmm``); ``own``: ``acc`` may be added into.
    ``lhs`` may be :class:`GatedRows` (made and added a chunk at a time, or folded into one d × d matrix per
    position where :func:`~detjac.engine.pieces.fold.fold_pays` says so)."""
    lhs, rhs, s = product
    b, m, d = acc.shape
    if isinstance(lhs, GatedRows):
        if s == sa and fold_pays(lhs.weight.shape[0], lhs.weight.shape[1], b):  # priced per layer and block
            return plus_folded(acc, lhs, rhs), sa
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
    """A decoder layer as ``mid = h + attention(h)``, ``out = mid + mlp(mid)``; in a post-norm layer (BERT) the
    residual sums go through norms: ``mid = N1(h + attention(h))``, ``out = N2(mid + mlp(mid))``."""

    attention: Core
    mlp: Core
    attention_norm: NormPiece | None = None  # the post-norm on the attention's residual sum (BERT)
    mlp_norm: NormPiece | None = None  # the post-norm on the MLP's residual sum (BERT)


@dataclass
class PiecesPull:
    """A layer's pieces as the pullback primitive crosses it (:class:`~detjac.engine.pullback.LayerPull`)."""

    pieces: LayerPieces
    mid: torch.Tensor | None = None  # (n, d) the layer's mid residual on the prompt: its MLP's input
    input: torch.Tensor | None = None  # (n, d) the layer's input on the prompt: what its heads read

    def pull(self, g_out: torch.Tensor, g_mid: torch.Tensor | None, s: int, cut: bool) -> tuple[torch.Tensor, int]:
        with torch.no_grad():
            return pull_layer(self.pieces, g_out, g_mid, s, cut)

    def activations(self) -> torch.Tensor:
        """(n, n_neurons) the MLP's neurons on the prompt."""
        assert self.mid is not None, "a walk that hands out layers for activations gives their mid residual"
        with torch.no_grad():
            return self.pieces.mlp.activations(self.mid)

    def mlp(self) -> Any:
        """The MLP's piece (:class:`Mlp` or :class:`~detjac.engine.pieces.experts.Moe`): read and write vectors."""
        return self.pieces.mlp

    def attention(self) -> Any:
        return self.pieces.attention

    def neuron_cotangents(self, g_out: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.pieces.mlp.neuron_cotangents(g_out)

    def neuron_seeds(self, g: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.pieces.mlp.neuron_seeds(g)


def pull_layer(pieces: LayerPieces, g_out: torch.Tensor, g_mid: torch.Tensor | None, s: int, cut: bool = False
               ) -> tuple[torch.Tensor, int]:
    """Cotangents (B, n, d) at a layer's output and mid residual (None: zero), zero before position ``s`` (< n),
    -> (B, n, d) at its input, and the first position from which they may be nonzero. ``cut``: the MLP's output is
    held fixed (only the residual path crosses it)."""
    n = g_out.shape[1]
    top = g_out[:, s:]
    if pieces.mlp_norm is not None:
        top = pieces.mlp_norm.transpose(top, s)
    if cut:
        gm, sm = top.clone(), s
    else:
        gm, sm = cross(top, s, pieces.mlp, top, s, up=False)  # the residual passes the output's on
    if g_mid is not None:
        gm[:, s - sm:] += g_mid[:, s:]
    if pieces.attention_norm is not None:
        gm = pieces.attention_norm.transpose(gm, sm)
    gi, si = cross(gm, sm, pieces.attention, gm, sm, up=False, own=True)
    if si == 0:
        return gi, 0
    full = gi.new_zeros(gi.shape[0], n, gi.shape[2])
    full[:, si:] = gi
    return full, si


def push_layer(pieces: LayerPieces, tangent: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tangents (c, n - s, d) at a layer's input (positions s:) -> (at its output, at its mid residual)."""
    t_mid = cross(tangent, s, pieces.attention, tangent, s, up=True)[0]
    if pieces.attention_norm is not None:
        t_mid = pieces.attention_norm.apply(t_mid, s)
    t_out = cross(t_mid, s, pieces.mlp, t_mid, s, up=True)[0]
    return (pieces.mlp_norm.apply(t_out, s) if pieces.mlp_norm is not None else t_out), t_mid


def check_layer(pieces: LayerPieces, h: torch.Tensor, out: torch.Tensor, mid: torch.Tensor) -> None:
    """Check that the pieces rebuild the layer's (out, mid) from its input ``h`` (n, d); raises
    :class:`~detjac.engine.pieces.NotAPiece` saying what differs where they do not.

    The bound is :func:`detjac.exactness.pieces_bound` (loose: it catches a wrong wiring or an unfolded factor).
    """
    with torch.no_grad():
        out_hat, mid_hat = (t[0] for t in push_layer(pieces, h[None], 0))
    check_rebuilt(mid_hat, mid, "the layer's mid residual")
    check_rebuilt(out_hat, out, "the layer's output")


def check_rebuilt(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Raise :class:`~detjac.engine.pieces.NotAPiece` where pieces rebuild ``want`` (``what``) as ``got`` with a
    relative error above :func:`detjac.exactness.pieces_bound`."""
    bound = pieces_bound(want.dtype)
    err = float((got - want).norm() / want.norm().clamp_min(torch.finfo(want.dtype).tiny))
    if not err <= bound:
        raise NotAPiece(f"its pieces rebuild {what} with relative error {err:.1e} (bound {bound:g})")
