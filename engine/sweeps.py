"""The sweeps of the layer-streamed engine: blocks of vectors through one detached layer at a time.

**Reverse mode** (:func:`reverse`, row blocks): a block of cotangent rows of every requested
target goes from the top layer down, through ``torch.func.vjp`` of one detached layer at a
time, vmapped over the block. Targets deeper in the model join the block as the sweep
reaches their layer, so one sweep serves them all and each layer's weights are read once
per block. Where a layer's cotangents are zero before some position (the top layer: they
sit at the target position only; below a sliding window, a band), the layer is pulled back
from the outputs of the later positions only (:meth:`~detjac.engine.tracing.LayerSteps.pulled_suffix_step`).

**Forward mode** (:func:`forward`, column blocks): tangents of whole tokens' input columns go
from the bottom layer up through ``torch.func.jvp``; every layer's cumulative Jacobian (its
output, attention and MLP contributions w.r.t. the input embeddings) is read off on the way,
in one sweep per column block. The tangents of tokens ``k0:k1`` are zero before position
``k0``, so they are carried over positions ``k0:`` only
(:meth:`~detjac.engine.tracing.LayerSteps.suffix_step`).

Both also take arbitrary vectors instead of basis ones (``seed``, ``tangent``): that is how the
matrix-free operator's products ``J^T u`` and ``J v`` are computed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from detjac.targets import OUTPUTS, Target

from .backend import JacobianBlock
from .progress import progress_bar
from .skeleton import Skeleton
from .tracing import LayerSteps, StreamedTrace


def reverse(sk: Skeleton, steps: LayerSteps, trace: StreamedTrace, targets: list[Target], r0: int, r1: int,
            progress: bool = False, seed: torch.Tensor | None = None) -> Iterator[JacobianBlock]:
    """Rows ``r0:r1`` of every target; with ``seed`` (r1 - r0, n, d), its rows at the target position are
    pulled back instead of the basis rows ``r0:r1``: the values are then ``seed[:, p] @ J`` (matrix-free)."""
    n, d, p, L = len(trace.token_ids), sk.d_model, trace.position, sk.n_layers
    dev, dt = sk.device, sk.dtype
    if seed is None:
        seed = torch.zeros(r1 - r0, n, d, dtype=dt, device=dev)
        seed[torch.arange(r1 - r0), p, torch.arange(r0, r1)] = 1.0
    active: list[tuple[Target, torch.Tensor]] = []  # cotangents at the current layer's output
    if any(t.component == "output" for t in targets):
        _, pull = torch.func.vjp(steps.final(p), trace.inputs[L].to(dev))
        with torch.no_grad():
            active.append((OUTPUTS, torch.func.vmap(pull)(seed[:, p])[0]))
    top = max((L - 1 if t.component == "output" else t.layer) for t in targets)
    dense = False  # once the cotangents reach position 0 they stay there (the residual path passes them on)
    for i in progress_bar(range(top, -1, -1), progress, "reverse sweep", "layer", leave=False):
        # (target, cotangent at the layer's output, at its mid residual); None: zero
        entries: list[tuple[Target, torch.Tensor | None, torch.Tensor | None]] = [(t, g, None) for t, g in active]
        for t in (t for t in targets if t.layer == i and t.component != "output"):
            if t.component == "layer":
                entries.append((t, seed, None))
            elif t.component == "attn":
                entries.append((t, None, seed))
            else:
                entries.append((t, seed, -seed))
        if not entries:
            continue
        g_out = _stacked([e[1] for e in entries], seed)
        g_mid = _stacked([e[2] for e in entries], seed) if any(e[2] is not None for e in entries) else None
        del entries[:]  # the concatenated copies are all that is kept
        with sk.layer(i):
            h = trace.inputs[i].to(dev)
            s = 0 if dense else _first_nonzero_position(*(g for g in (g_out, g_mid) if g is not None))
            step = steps.pulled_suffix_step(i, trace.calls, h, s) if 0 < s < n else None
            if step is None:
                step, s = steps.step(i, trace.calls), 0
            dense = s == 0
            if g_mid is None:  # only the output's cotangents: the mid residual is not pulled back
                _, pull = torch.func.vjp(lambda x, step=step: step(x)[0], h)
                cotangents: Any = g_out[:, s:]
            else:
                _, pull = torch.func.vjp(step, h)
                cotangents = (g_out[:, s:], g_mid[:, s:])
            with torch.no_grad():
                g_in = torch.func.vmap(pull)(cotangents)[0]
        del g_out, g_mid
        order = [t for t, _ in active] + [t for t in targets if t.layer == i and t.component != "output"]
        active = []
        for j, t in enumerate(order):
            g = g_in[j * (r1 - r0):(j + 1) * (r1 - r0)]
            if t.component == "attn" and t.layer == i:
                g = g - seed  # attn = mid - input: the identity path leaves
            if t.local and t.layer == i:
                yield JacobianBlock(t, r0, r1, 0, n, g)
            else:
                active.append((t, g))
    for t, g in active:
        yield JacobianBlock(t, r0, r1, 0, n, g)


def forward(sk: Skeleton, steps: LayerSteps, trace: StreamedTrace, targets: list[Target], k0: int, k1: int,
            progress: bool = False, tangent: torch.Tensor | None = None) -> Iterator[JacobianBlock]:
    """Columns of tokens ``k0:k1`` of every target; with ``tangent`` (c, n, d), those directions are pushed
    instead of the basis columns, and each block's values are the products ``J @ tangent`` (d, c)."""
    n, d, p, L = len(trace.token_ids), sk.d_model, trace.position, sk.n_layers
    basis = tangent is None
    if tangent is None:
        c = (k1 - k0) * d
        s = k0  # causal truncation: the basis tangents are zero before position s, which they do not carry
        tangent = torch.zeros(c, n - s, d, dtype=sk.dtype, device=sk.device)
        cols = torch.arange(c)
        tangent[cols, k0 - s + cols // d, cols % d] = 1.0
    else:  # arbitrary directions over every position
        c, s = tangent.shape[0], 0
    top = max((L - 1 if t.component == "output" else t.layer) for t in targets)

    def columns(t: Target, v: torch.Tensor) -> JacobianBlock:  # v: (c, d) -> (d, k1 - k0, d), or (d, c)
        return JacobianBlock(t, 0, d, k0, k1, v.T.reshape(d, k1 - k0, d) if basis else v.T)

    def at(v: torch.Tensor) -> torch.Tensor:  # (c, n - s, d) -> (c, d) at the target position
        return v[:, p - s] if p >= s else v.new_zeros(c, d)

    for i in progress_bar(range(top + 1), progress, "forward sweep", "layer", leave=False):
        with sk.layer(i), torch.no_grad():
            h = trace.inputs[i].to(sk.device)
            step = steps.suffix_step(i, trace.calls, h, s) if s > 0 else None
            if step is None:
                if s > 0:  # not truncatable exactly: carry the zeros again
                    tangent = torch.cat([tangent.new_zeros(c, s, d), tangent], dim=1)
                    s = 0
                step = steps.step(i, trace.calls)
            hs = h[s:]
            t_out, t_mid = torch.func.vmap(lambda v, step=step, hs=hs: torch.func.jvp(step, (hs,), (v,))[1])(
                tangent)
        for t in (t for t in targets if t.layer == i):
            if t.component == "layer":
                yield columns(t, at(t_out))
            elif t.component == "attn":
                yield columns(t, at(t_mid) - at(tangent))
            else:
                yield columns(t, at(t_out) - at(t_mid))
        tangent = t_out
        del t_mid
    if any(t.component == "output" for t in targets):
        h = trace.inputs[L][s:].to(sk.device)
        with torch.no_grad():
            y = torch.func.vmap(lambda v: torch.func.jvp(steps.final(p - s), (h,), (v,))[1])(tangent) \
                if p >= s else tangent.new_zeros(c, d)
        yield columns(OUTPUTS, y)


def _stacked(parts: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """``parts`` (each like ``like`` or None for zeros) stacked along the block axis; one part is not copied."""
    if len(parts) == 1 and parts[0] is not None:
        return parts[0]
    return torch.cat([torch.zeros_like(like) if g is None else g for g in parts])


def _first_nonzero_position(*cotangents: torch.Tensor) -> int:
    """The first position (axis 1) where any of ``cotangents`` (block, n, d) is nonzero; n if none is."""
    used = torch.stack([g.ne(0).any(dim=2).any(dim=0) for g in cotangents]).any(dim=0)
    hits = used.nonzero()
    return int(hits[0]) if hits.numel() else int(used.shape[0])
