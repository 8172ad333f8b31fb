"""The sweeps of the layer-streamed engine: blocks of vectors through one detached layer at a time.

:func:`reverse` takes row blocks from the top layer down, :func:`forward` token blocks from the bottom up (causally
truncated); both also take arbitrary vectors, for the matrix-free operator. Details: docs/engine.md, "Reverse and
forward sweeps"."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from detjac.errors import InvalidArgumentError
from detjac.progress import progress_bar
from detjac.targets import OUTPUTS, RESID_MID, Target

from ..pullback import EMBEDDINGS, EVERY_POSITION, LayerPull, PullRequest, Seed, Site, input_of, pulls
from ..pullback import OUTPUT as OUTPUT_SITE
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


def reverse(sk: Skeleton, steps: LayerSteps, trace: StreamedTrace, targets: list[Target], r0: int, r1: int,
            progress: bool = False, seed: torch.Tensor | None = None, adjoint: AutogradAdjoint | None = None,
            every_position: bool = False) -> Iterator[JacobianBlock]:
    """Rows ``r0:r1`` of every target; with ``seed`` (r1 - r0, n, d), its rows at the target position are
    pulled back instead of the basis rows ``r0:r1``: the values are then ``seed[:, p] @ J`` (matrix-free).
    With ``every_position`` the seed's rows at *every* position are pulled back through the final normed state
    there, so the output's cotangents at layer ``L`` are ``sum_p' seed[:, p'] @ dy_p' / dh_L`` (the Jacobian lens
    of the literature sums these over ``p'``); only the output and ``to_output`` targets are then defined.

    Each target is one :class:`~detjac.engine.pullback.PullRequest` (the output and every ``to_output`` share one:
    ``to_output.L`` is the output's cotangents at layer ``L``'s output), swept together by
    :func:`~detjac.engine.pullback.pulls`. ``adjoint`` moves the block through each layer (default: ``torch.func``)."""
    n, d, p = len(trace.token_ids), sk.d_model, trace.position
    rows = r1 - r0
    adjoint = adjoint if adjoint is not None else AutogradAdjoint(sk, steps)
    if seed is None:
        seed = torch.zeros(rows, n, d, dtype=sk.dtype, device=sk.device)
        seed[torch.arange(rows), p, torch.arange(r0, r1)] = 1.0
    swept = [t for t in targets if not t.is_output and not t.is_to_output]
    if every_position and (swept or seed.shape[:2] != (rows, n)):
        raise InvalidArgumentError("Expected only output and to_output targets and a seed (rows, n_tokens, d) for a "
                                   f"sweep from every position. Got {', '.join(t.name for t in swept) or 'no'} other "
                                   f"targets and a seed of shape {tuple(seed.shape)}.")
    requests, owners = _requests(steps, trace, targets, seed, every_position)
    walk = StreamedWalk(sk, steps, trace, adjoint)
    bar = progress_bar(None, progress, "reverse sweep", "layer", total=sk.n_layers, leave=False)
    last = sk.n_layers
    try:
        for j, site, values in pulls(walk, requests):
            if bar is not None and site.kind == "input" and site.layer < last:
                bar.update(last - site.layer)
                last = site.layer
            block = JacobianBlock(owners[j][site], r0, r1, 0, n, values)
            del values
            yield block
            del block  # a read the caller has taken is not held while the sweep goes on
    finally:
        if bar is not None:
            bar.close()


def _requests(steps: LayerSteps, trace: StreamedTrace, targets: list[Target], seed: torch.Tensor,
              every_position: bool) -> tuple[list[PullRequest], list[dict[Site, Target]]]:
    """One pull request per target (the output and the ``to_output`` targets share one), and which target each
    request's reads belong to."""
    requests: list[PullRequest] = []
    owners: list[dict[Site, Target]] = []
    to_output = [t for t in targets if t.is_to_output]
    want_output = any(t.is_output for t in targets)
    if want_output or to_output:
        site_seed = Seed(EVERY_POSITION, seed) if every_position else Seed(OUTPUT_SITE, seed[:, trace.position])
        owner = {input_of(t.layer + 1): t for t in to_output}
        if want_output:
            owner[EMBEDDINGS] = OUTPUTS
        requests.append(PullRequest((site_seed,), tuple(owner)))
        owners.append(owner)
    for t in (t for t in targets if not t.is_output and not t.is_to_output):
        own = _normed_seed(steps, trace, t, seed) if t.normed else seed
        read = input_of(t.layer) if t.local else EMBEDDINGS
        requests.append(PullRequest((Seed(_seed_site(t), own),), (read,)))
        owners.append({read: t})
    return requests, owners


def _seed_site(t: Target) -> Site:
    """Where a layer target's cotangents enter: its residual-stream vector."""
    kind = {"layer": "input", "attn": "attn", RESID_MID: "mid", "mlp": "mlp"}[t.base]
    return Site(kind, t.layer + 1 if kind == "input" else t.layer)


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
