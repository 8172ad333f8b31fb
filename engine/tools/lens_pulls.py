"""The Jacobian lens's per-text pullbacks, on the pullback primitive of any engine: a cotangent set at every
position's final normed state (:func:`pull_every_position`, detjac's ``jlens``), or at the last layer's output at
chosen positions (:func:`pull_final_block`, the reference lens of TransformerLens' ``JacobianLens.fit``), pulled back
to the output of chosen layers. Used by the lens fit and its evaluation (docs/lens.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from detjac.errors import InvalidArgumentError
from detjac.targets import layer_index

from ..interface import Engine
from ..pullback import EVERY_POSITION, PullRequest, Seed, Site, input_of
from ..types import Trace

Reduce = Callable[[torch.Tensor], torch.Tensor]


def pull_every_position(engine: Engine, trace: Trace, cotangents: torch.Tensor, layers: Sequence[int],
                        reduce: Reduce | None = None) -> dict[int, torch.Tensor]:
    """``u`` (c, d) set at the final normed state of every position at once, pulled back to the output of each
    layer in ``layers``: ``{L: (c, n, d)}`` with ``[:, k] = sum_{p' >= k} u @ dy_p' / dh_{L,k}`` (causal: the
    later positions only). The per-text quantity of the Jacobian lens of Gurnee et al. (``jlens``), exact for
    the detached model (and for the ordinary one with ``detach=False``). ``reduce`` is applied to each layer's
    block as the sweep reaches it (e.g. a mean over positions), so that only its result is kept."""
    n, d = trace.n_tokens, engine.d_model
    seed = cotangents.to(device=engine.device, dtype=engine.dtype)[:, None, :].expand(-1, n, d).contiguous()
    return _pulled(engine, trace, Seed(EVERY_POSITION, seed), layers, reduce)


def pull_final_block(engine: Engine, trace: Trace, cotangents: torch.Tensor, layers: Sequence[int],
                     positions: Sequence[int], reduce: Reduce | None = None) -> dict[int, torch.Tensor]:
    """``u`` (c, d) set at the last layer's output (the final norm's input, before the norm) at each of
    ``positions`` at once, pulled back to the output of each layer in ``layers``: ``{L: (c, n, d)}`` with
    ``[:, k] = sum_{p' in positions, p' >= k} u @ dh_{final,p'} / dh_{L,k}``. The per-text quantity of the
    reference Jacobian lens (TransformerLens' ``JacobianLens.fit``: the target is the final block's output, the
    cotangent is set at the valid positions only); ``reduce`` as in :func:`pull_every_position`.

    Raises
    ------
    InvalidArgumentError
        No positions, or one outside the prompt.
    """
    n, d = trace.n_tokens, engine.d_model
    picked = sorted({int(p) for p in positions})
    if not picked or picked[0] < 0 or picked[-1] >= n:
        raise InvalidArgumentError(f"Expected target positions in [0, {n - 1}]. Got {list(positions)}.")
    u = cotangents.to(device=engine.device, dtype=engine.dtype)
    seed = u.new_zeros(u.shape[0], n, d)  # (c, n, d): u at the picked positions, 0 elsewhere
    seed[:, picked] = u[:, None, :]
    return _pulled(engine, trace, Seed(input_of(engine.n_layers), seed), layers, reduce)


def _pulled(engine: Engine, trace: Trace, seed: Seed, layers: Sequence[int], reduce: Reduce | None
            ) -> dict[int, torch.Tensor]:
    """``seed`` pulled back to the output of each of ``layers``, each block reduced as the sweep reaches it."""
    wanted: dict[Site, int] = {input_of(layer_index(layer, engine.n_layers) + 1): layer for layer in layers}
    out: dict[int, torch.Tensor] = {}
    for _, site, values in engine.pulls(trace, [PullRequest((seed,), tuple(wanted))]):
        out[wanted[site]] = reduce(values) if reduce is not None else values
    return {layer: out[layer] for layer in layers}
