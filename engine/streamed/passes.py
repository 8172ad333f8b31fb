"""The sweeps of the layer-streamed engine: blocks of vectors through one detached layer at a time.

:func:`reverse` takes row blocks from the top layer down, :func:`forward` token blocks from the bottom up (causally
truncated); both also take arbitrary vectors, for the matrix-free operator. Details: docs/engine.md, "Reverse and
forward sweeps"."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from detjac.errors import InvalidArgumentError
from detjac.progress import progress_bar
from detjac.targets import OUTPUTS, RESID_MID, Target

from ..interface import JacobianBlock
from .adjoint import AutogradAdjoint
from .skeleton import Skeleton
from .tracing import LayerSteps, StreamedTrace


def reverse(sk: Skeleton, steps: LayerSteps, trace: StreamedTrace, targets: list[Target], r0: int, r1: int,
            progress: bool = False, seed: torch.Tensor | None = None, adjoint: AutogradAdjoint | None = None,
            every_position: bool = False) -> Iterator[JacobianBlock]:
    """Rows ``r0:r1`` of every target; with ``seed`` (r1 - r0, n, d), its rows at the target position are
    pulled back instead of the basis rows ``r0:r1``: the values are then ``seed[:, p] @ J`` (matrix-free).
    With ``every_position`` the seed's rows at *every* position are pulled back through the final normed state
    there, so the output's cotangents at layer ``L`` are ``sum_p' seed[:, p'] @ dy_p' / dh_L`` (the Jacobian lens
    of the literature sums these over ``p'``); only the output and ``to_output`` targets are then defined.

    The output's cotangents at layer ``L``'s output *are* rows of ``to_output.L``: those targets are read off
    the output's sweep on the way down (computed whenever one is requested, even without the output).
    ``adjoint`` moves the block through each layer (default: ``torch.func``)."""
    n, d, p, L = len(trace.token_ids), sk.d_model, trace.position, sk.n_layers
    dev, dt, rows = sk.device, sk.dtype, r1 - r0
    adjoint = adjoint if adjoint is not None else AutogradAdjoint(sk, steps)
    if seed is None:
        seed = torch.zeros(rows, n, d, dtype=dt, device=dev)
        seed[torch.arange(rows), p, torch.arange(r0, r1)] = 1.0
    to_output = {t.layer: t for t in targets if t.is_to_output}
    want_output = any(t.is_output for t in targets)
    swept = [t for t in targets if not t.is_output and not t.is_to_output]
    active: list[tuple[Target, torch.Tensor]] = []  # cotangents at the current layer's output
    if every_position and (swept or seed.shape[:2] != (rows, n)):
        raise InvalidArgumentError("Expected only output and to_output targets and a seed (rows, n_tokens, d) for a "
                                   f"sweep from every position. Got {', '.join(t.name for t in swept) or 'no'} other "
                                   f"targets and a seed of shape {tuple(seed.shape)}.")
    if want_output or to_output:
        active.append((OUTPUTS, adjoint.pull_final_every(trace, seed) if every_position
                       else adjoint.pull_final(trace, seed[:, p])))
    top = L - 1 if active else max(t.layer for t in swept)
    dense = False  # once the cotangents reach position 0 they stay there (the residual path passes them on)
    for i in progress_bar(range(top, -1, -1), progress, "reverse sweep", "layer", leave=False):
        if i in to_output:  # dy/dh_i: the output's cotangents at layer i's output, every position
            yield JacobianBlock(to_output[i], r0, r1, 0, n, active[0][1])
            if not want_output and i == min(to_output):
                active = active[1:]
        # (target, cotangent at the layer's output, at its mid residual); None: zero
        entries: list[tuple[Target, torch.Tensor | None, torch.Tensor | None]] = [(t, g, None) for t, g in active]
        joining = [t for t in swept if t.layer == i]
        own: dict[Target, torch.Tensor] = {}  # each joining target's cotangent at its own vector
        for t in joining:
            own[t] = _normed_seed(steps, trace, t, seed) if t.normed else seed
            entries.append((t, *_layer_seeds(t, own[t])))
        if not entries:
            continue
        g_out = _stacked([e[1] for e in entries], seed)
        g_mid = _stacked([e[2] for e in entries], seed) if any(e[2] is not None for e in entries) else None
        del entries[:]  # the concatenated copies are all that is kept
        with sk.layer(i):
            h = trace.inputs[i].to(dev)
            s = 0 if dense else _first_nonzero_position(*(g for g in (g_out, g_mid) if g is not None))
            g_in, s = adjoint.pull_layer(i, trace, h, g_out, g_mid, s)
            dense = s == 0
        del g_out, g_mid
        order = [t for t, _ in active] + joining
        active = []
        for j, t in enumerate(order):
            g = g_in[j * rows:(j + 1) * rows]
            if t in own and t.base == "attn":
                g = g - own[t]  # attn = mid - input: the identity path leaves
            if t in own and t.local:
                yield JacobianBlock(t, r0, r1, 0, n, g)
            else:
                active.append((t, g))
    for t, g in active:
        yield JacobianBlock(t, r0, r1, 0, n, g)


def _layer_seeds(t: Target, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Cotangents at a layer's output and at its mid residual for cotangents ``g`` at target ``t``'s vector."""
    base = t.base
    if base == "layer":
        return g, None
    if base in ("attn", RESID_MID):  # attn = mid - input (the identity is taken off after the pullback)
        return None, g
    return g, -g  # mlp = output - mid


def _normed_seed(steps: LayerSteps, trace: StreamedTrace, t: Target, seed: torch.Tensor) -> torch.Tensor:
    """``seed`` at the position times the final norm's Jacobian ``M`` at the target's own vector: the cotangents of
    the un-normed vector that give the normed target's rows (``J_normed = M J``)."""
    p = trace.position
    M = steps.norm_matrix(trace.base_value(t).to(seed.device))  # (d, d)
    out = torch.zeros_like(seed)
    out[:, p] = seed[:, p] @ M
    return out


def forward(sk: Skeleton, steps: LayerSteps, trace: StreamedTrace, targets: list[Target], k0: int, k1: int,
            progress: bool = False, tangent: torch.Tensor | None = None, adjoint: AutogradAdjoint | None = None
            ) -> Iterator[JacobianBlock]:
    """Columns of tokens ``k0:k1`` of every target; with ``tangent`` (c, n, d), those directions are pushed
    instead of the basis columns, and each block's values are the products ``J @ tangent`` (d, c).
    ``adjoint`` moves the block through each layer (default: ``torch.func``)."""
    n, d, p, L = len(trace.token_ids), sk.d_model, trace.position, sk.n_layers
    adjoint = adjoint if adjoint is not None else AutogradAdjoint(sk, steps)
    basis = tangent is None
    if tangent is None:
        c = (k1 - k0) * d
        s = k0  # causal truncation: the basis tangents are zero before position s, which they do not carry
        tangent = torch.zeros(c, n - s, d, dtype=sk.dtype, device=sk.device)
        cols = torch.arange(c)
        tangent[cols, k0 - s + cols // d, cols % d] = 1.0
    else:  # arbitrary directions over every position
        c, s = tangent.shape[0], 0
    top = max((L - 1 if t.is_output else t.layer) for t in targets)

    def columns(t: Target, v: torch.Tensor) -> JacobianBlock:  # v: (c, d) -> (d, k1 - k0, d), or (d, c)
        return JacobianBlock(t, 0, d, k0, k1, v.T.reshape(d, k1 - k0, d) if basis else v.T)

    def at(v: torch.Tensor) -> torch.Tensor:  # (c, n - s, d) -> (c, d) at the target position
        return v[:, p - s] if p >= s else v.new_zeros(c, d)

    for i in progress_bar(range(top + 1), progress, "forward sweep", "layer", leave=False):
        with sk.layer(i), torch.no_grad():
            h = trace.inputs[i].to(sk.device)
            tangent, t_out, t_mid, s = adjoint.push_layer(i, trace, h, tangent, s)  # s = 0: not truncatable
        for t in (t for t in targets if t.layer == i and not t.is_output):
            v = _layer_tangent(t.base, at(t_out), at(t_mid), at(tangent))
            if t.normed:  # M v for each column v: the final norm frozen at the target's own vector
                v = v @ steps.norm_matrix(trace.base_value(t).to(v.device)).T
            yield columns(t, v)
        tangent = t_out
        del t_mid
    if any(t.is_output for t in targets):
        yield columns(OUTPUTS, adjoint.push_final(trace, tangent, s))


def _layer_tangent(base: str, out: torch.Tensor, mid: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """Tangents of the residual-stream vector ``base`` from those of a layer's output, mid residual and input."""
    if base == "layer":
        return out
    if base == "attn":
        return mid - inp
    if base == RESID_MID:
        return mid
    return out - mid


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
