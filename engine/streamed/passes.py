"""The layer-streamed engine's walk: blocks of vectors through one detached layer at a time.

:class:`StreamedWalk` is what the sweeps (:mod:`detjac.engine.sweeps`) cross from the top layer down, row block by
row block; forward mode, which only this engine has, is its :meth:`~StreamedWalk.columns` (:func:`forward`: token
blocks from the bottom up, causally truncated) and :meth:`~StreamedWalk.push` (arbitrary directions, for the
matrix-free operator). Details: docs/engine.md, "Reverse and forward sweeps"."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from detjac.progress import progress_bar
from detjac.targets import OUTPUTS, RESID_MID, Target

from ..pullback import OUTPUT as OUTPUT_SITE
from ..pullback import LayerPull, PullRequest, Seed
from ..types import JacobianBlock
from .adjoint import AutogradAdjoint
from .skeleton import Skeleton
from .tracing import LayerSteps, StreamedTrace


class StreamedWalk:
    """The layer-streamed engine as a :class:`~detjac.engine.pullback.Walk`: each layer read in (and recorded as
    pieces, or crossed by ``torch.func``) as the sweep reaches it."""

    def __init__(self, sk: Skeleton, steps: LayerSteps, trace: StreamedTrace, adjoint: AutogradAdjoint) -> None:
        self.sk, self.steps, self.trace, self.adjoint = sk, steps, trace, adjoint
        self.n_layers, self.n_tokens = sk.n_layers, len(trace.token_ids)

    def supports(self, request: PullRequest) -> str | None:
        needs = request.cut or any(s.site.kind == "neurons" for s in request.seeds) or any(
            r.kind == "neurons" for r in request.reads)
        if needs and not self.steps.detach:
            return "the ordinary Jacobian has no frozen neurons and no cut"
        if needs and self.adjoint.name != "explicit":
            return "cuts and neurons need the explicit sweeps (the autograd sweeps were chosen)"
        return None

    def final(self, seed: Seed) -> torch.Tensor:
        if seed.site == OUTPUT_SITE:
            return self.adjoint.pull_final(self.trace, seed.values)
        return self.adjoint.pull_final_every(self.trace, seed.values)

    @contextmanager
    def layer(self, i: int) -> Iterator[LayerPull]:
        with self.sk.layer(i):
            yield self.adjoint.layer_pull(i, self.trace, self.trace.inputs[i].to(self.sk.device))

    def embed(self, g: torch.Tensor) -> torch.Tensor:
        return g  # nothing between the embeddings and the first layer in a streamable family

    def enter(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def residual_ends(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.trace.inputs[0].to(self.sk.device), self.trace.inputs[-1].to(self.sk.device)

    def norm_matrix(self, v: torch.Tensor) -> torch.Tensor:
        """(d, d) the final norm's Jacobian, frozen at ``v`` (d,): the ``*_normed`` targets' map."""
        return self.steps.norm_matrix(v)

    def columns(self, targets: list[Target], k0: int, k1: int, progress: bool = False) -> Iterator[JacobianBlock]:
        """Forward mode: the columns of tokens ``k0:k1`` of every target (:func:`forward`)."""
        return forward(self.sk, self.steps, self.trace, targets, k0, k1, progress, adjoint=self.adjoint)

    def push(self, tangents: torch.Tensor) -> torch.Tensor:
        """``J v`` of the output by one forward-mode sweep: (c, n, d) -> (c, d)."""
        (block,) = forward(self.sk, self.steps, self.trace, [OUTPUTS], 0, tangents.shape[0], tangent=tangents,
                           adjoint=self.adjoint)
        return block.values.T


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
