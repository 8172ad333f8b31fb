"""Every product of a prompt's Jacobian, written once over any engine's :class:`~detjac.engine.pullback.Walk`.

:func:`plan` splits a request between reverse and forward mode and sizes its blocks by the engine's cost model;
:func:`blocks` yields every requested Jacobian block by block: reverse mode as :func:`reverse`, one sweep of the
pullback primitive (:func:`~detjac.engine.pullback.pulls`) per row block, forward mode as columns a walk pushes (the
layer-streamed walk; the in-memory engine plans reverse mode only); :func:`push` is ``J v``. Neither engine keeps a
block loop of its own: each hands out its walk (:meth:`~detjac.engine.Engine.walk`).

NOTE [where the numbers are made]: a row block's values are made in :func:`~detjac.engine.pullback.pulls`, one loop
from the output down, layer by layer, through what the walk hands out: a layer's explicit pieces
(:meth:`~detjac.engine.pieces.layer.PiecesPull.pull`, the transposed layer as plain matmuls) or, for the autograd
walks, ``torch.func.vjp`` (the reference, the ordinary Jacobian, and the fallback for a piece without a rule).
Details: docs/engine.md, "How a block is computed"."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from detjac.errors import InvalidArgumentError
from detjac.progress import progress_bar
from detjac.targets import OUTPUTS, RESID_MID, Target

from .cost import MODES
from .pullback import EMBEDDINGS, EVERY_POSITION, OUTPUT, PullRequest, Seed, Site, input_of, pulls
from .types import JacobianBlock, Plan, Trace

# An engine (:class:`~detjac.engine.interface.Engine`, whose derived methods call these functions: not imported here).
Engine = Any


def plan(engine: Engine, trace: Trace, targets: Sequence[Target], *, mode: str = "auto",
         row_block: int | None = None, token_block: int | None = None) -> Plan:
    """Split ``targets`` between reverse and forward mode and size the blocks, by the engine's cost model
    (:meth:`~detjac.engine.Engine.cost_model`).

    Raises
    ------
    InvalidArgumentError
        A target this engine cannot compute (layer targets and forward mode need the layer-streamed engine), an
        unknown mode, a non-positive block, or a memory budget too small for one block.
    """
    if not engine.layerwise:
        if mode not in MODES or mode == "forward":
            raise InvalidArgumentError(f"Expected mode auto or reverse for the in-memory engine. Got {mode!r}.")
        others = [t.name for t in targets if not t.is_output]
        if others:
            raise InvalidArgumentError(
                f"Expected only the 'output' target from the in-memory engine. Got {', '.join(others)}: layerwise "
                "targets need the layer-streamed engine (detjac run --layers, or StreamedEngine)."
            )
        mode = "reverse"
    return engine.cost_model(trace).plan(trace.n_tokens, targets, mode=mode, row_block=row_block,
                                         token_block=token_block)


def blocks(engine: Engine, trace: Trace, targets: Sequence[Target], plan_: Plan | None = None, *,
           progress: bool = False) -> Iterator[JacobianBlock]:
    """Every requested Jacobian, block by block: reverse mode's row blocks first, then forward mode's token blocks.

    Raises
    ------
    InvalidArgumentError
        As :func:`plan` raises it, when no plan is given.
    """
    planned = plan_ if plan_ is not None else plan(engine, trace, targets)
    d, n = engine.d_model, trace.n_tokens
    bar = progress_bar(None, progress, "blocks", "block", total=planned.n_blocks)
    try:
        with engine.walk(trace, planned) as walk:
            for r0 in range(0, d, planned.row_block) if planned.reverse else ():
                yield from reverse(engine, walk, trace, planned.reverse, r0, min(r0 + planned.row_block, d), progress)
                if bar is not None:
                    bar.update()
            for k0 in range(0, n, planned.token_block) if planned.forward else ():
                yield from walk.columns(planned.forward, k0, min(k0 + planned.token_block, n), progress)
                if bar is not None:
                    bar.update()
    finally:
        if bar is not None:
            bar.close()


def push(engine: Engine, trace: Trace, tangents: torch.Tensor) -> torch.Tensor:
    """``J v`` of the output's Jacobian: (c, n_tokens, d_model) input directions -> (c, d_model)."""
    with engine.walk(trace) as walk:
        return walk.push(tangents.to(device=engine.device, dtype=engine.dtype))


def reverse(engine: Engine, walk: Any, trace: Trace, targets: Sequence[Target], r0: int, r1: int,
            progress: bool = False, seed: torch.Tensor | None = None, every_position: bool = False
            ) -> Iterator[JacobianBlock]:
    """Rows ``r0:r1`` of every target, by one sweep of ``walk`` (``engine``'s); with ``seed`` (r1 - r0, n, d), its
    rows at the target position are pulled back instead of the basis rows ``r0:r1``: the values are then
    ``seed[:, p] @ J`` (matrix-free). With ``every_position`` the seed's rows at *every* position are pulled back
    through the final normed state there, so the output's cotangents at layer ``L`` are
    ``sum_p' seed[:, p'] @ dy_p' / dh_L`` (the Jacobian lens of the literature sums these over ``p'``); only the
    output and ``to_output`` targets are then defined.

    Each target is one :class:`~detjac.engine.pullback.PullRequest` (the output and every ``to_output`` share one:
    ``to_output.L`` is the output's cotangents at layer ``L``'s output), swept together by
    :func:`~detjac.engine.pullback.pulls`.

    Raises
    ------
    InvalidArgumentError
        A sweep from every position with other targets or a seed of another shape.
    """
    n, p, rows, d = trace.n_tokens, trace.position, r1 - r0, engine.d_model
    if seed is None:
        seed = torch.zeros(rows, n, d, dtype=engine.dtype, device=engine.device)
        seed[torch.arange(rows), p, torch.arange(r0, r1)] = 1.0
    swept = [t for t in targets if not t.is_output and not t.is_to_output]
    if every_position and (swept or seed.shape[:2] != (rows, n)):
        raise InvalidArgumentError("Expected only output and to_output targets and a seed (rows, n_tokens, d) for a "
                                   f"sweep from every position. Got {', '.join(t.name for t in swept) or 'no'} other "
                                   f"targets and a seed of shape {tuple(seed.shape)}.")
    requests, owners = _requests(walk, trace, targets, seed, every_position)
    bar = progress_bar(None, progress and walk.n_layers > 0, "reverse sweep", "layer", total=walk.n_layers,
                       leave=False)
    last = walk.n_layers
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


def _requests(walk: Any, trace: Trace, targets: Sequence[Target], seed: torch.Tensor, every_position: bool
              ) -> tuple[list[PullRequest], list[dict[Site, Target]]]:
    """One pull request per target (the output and the ``to_output`` targets share one), and which target each
    request's reads belong to."""
    requests: list[PullRequest] = []
    owners: list[dict[Site, Target]] = []
    to_output = [t for t in targets if t.is_to_output]
    want_output = any(t.is_output for t in targets)
    if want_output or to_output:
        site_seed = Seed(EVERY_POSITION, seed) if every_position else Seed(OUTPUT, seed[:, trace.position])
        owner = {input_of(t.layer + 1): t for t in to_output}
        if want_output:
            owner[EMBEDDINGS] = OUTPUTS
        requests.append(PullRequest((site_seed,), tuple(owner)))
        owners.append(owner)
    for t in (t for t in targets if not t.is_output and not t.is_to_output):
        own = _normed_seed(walk, trace, t, seed) if t.normed else seed
        read = input_of(t.layer) if t.local else EMBEDDINGS
        requests.append(PullRequest((Seed(_seed_site(t), own),), (read,)))
        owners.append({read: t})
    return requests, owners


def _seed_site(t: Target) -> Site:
    """Where a layer target's cotangents enter: its residual-stream vector."""
    kind = {"layer": "input", "attn": "attn", RESID_MID: "mid", "mlp": "mlp"}[t.base]
    return Site(kind, t.layer + 1 if kind == "input" else t.layer)


def _normed_seed(walk: Any, trace: Any, t: Target, seed: torch.Tensor) -> torch.Tensor:
    """``seed`` at the position times the final norm's Jacobian ``M`` at the target's own vector: the cotangents of
    the un-normed vector that give the normed target's rows (``J_normed = M J``)."""
    p = trace.position
    M = walk.norm_matrix(trace.base_value(t).to(seed.device))  # (d, d)
    out = torch.zeros_like(seed)
    out[:, p] = seed[:, p] @ M
    return out
