"""Every attention head's exact direct effect on a graph's logit targets (docs/graphs.md, "Direct effects of heads").

Head ``(l, h)``'s direct effect on a target ``w`` is ``g · o_{l,h}[p]``: ``o_{l,h} = W_o,h P_h V_kv(h) x_l`` the
head's output (any frozen norm between the attention and the residual stream folded in, Gemma-3's post-attention
norm for one: :class:`~detjac.engine.Attention`; an affine family's value and output biases and its norms' shifts
left out, they are the graph's bias nodes), ``x_l`` the residual stream entering layer ``l``, ``p`` the predicted
position and ``g = ∂(w · y)/∂h_L[p]`` the target pulled back through the frozen final norm only (the cotangent of the
residual stream leaving the last layer). What is guaranteed: the residual stream at ``p`` leaving the last layer is
the embedding's stream at ``p`` plus every layer's attention and MLP outputs there, and a layer's attention output is
exactly the sum of its heads' outputs plus its constants, so for each target the heads of every layer, every MLP's
output (``g · mlp_l[p]``), the embedding's stream (``g · x_0[p]``) and the constants sum to the target's value. The
effects are those of the one detached model: nothing is ablated, no path through a later layer is counted.

Cost: one pass over the layers, each resident once (layer-streamed engines read each layer once); per layer one value
projection of the prompt and each head's query row ``p``, no pullback per head."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from detjac.engine import OUTPUT, Attention, Engine, Seed
from detjac.errors import InvalidArgumentError, UnsupportedModelError


def head_effects(engine: Engine, trace: Any, vectors: torch.Tensor,
                 layer_inputs: Mapping[int, torch.Tensor] | None = None) -> np.ndarray:
    """The direct effect of every head on each target (see the module docstring).

    Parameters
    ----------
    engine
        An engine with explicit pieces (in memory or layer-streamed, explicit sweeps).
    trace
        The engine's trace of the prompt; its position is the targets' ``p``.
    vectors
        (K, d_model) the targets: target ``k``'s value is ``vectors[k] · y``, ``y`` the final normed state at ``p``.
    layer_inputs
        Optional ``{layer: (n, d_model) residual stream entering it}`` used instead of the trace's own for those
        layers: the streams of another system with the same frozen factors (then the effects are that system's).

    Returns
    -------
    numpy.ndarray
        (K, n_layers, n_heads) float64: the direct effect of head ``h`` of layer ``l`` on target ``k``.

    Raises
    ------
    InvalidArgumentError
        Vectors not (K, d_model), a layer input of another layer or shape (before any layer is read); an engine or
        trace without explicit pieces (autograd sweeps, the ordinary Jacobian).
    UnsupportedModelError
        A layer whose attention is not one block of heads (a post-norm layer, whose residual sum is normed).
    """
    L, d, n, p = engine.n_layers, engine.d_model, trace.n_tokens, trace.position
    _check(vectors, layer_inputs or {}, L, n, d)
    heads = int(getattr(engine.config.get_text_config(), "num_attention_heads", 0))
    out = np.zeros((vectors.shape[0], L, heads))
    with engine.walk(trace) as walk, torch.no_grad():
        g: torch.Tensor | None = None
        for layer in range(L):
            with walk.layer(layer) as pull:  # refuses a walk without explicit layers (autograd) before any number
                attention = pull.attention()
                if not isinstance(attention, Attention):
                    raise UnsupportedModelError(f"Expected layer {layer}'s attention as one block of heads for its "
                                                f"heads' direct effects. Got {type(attention).__name__}.")
                x = (layer_inputs or {}).get(layer, pull.input)
                if x is None:
                    raise InvalidArgumentError(f"Expected a walk that keeps layer {layer}'s input for its heads' "
                                               f"direct effects. Got {type(walk).__name__}, which does not.")
                if g is None:  # (K, d) at p, leaving the last layer: only the final norm crossed
                    g = walk.final(Seed(OUTPUT, vectors.to(x)))[:, p]
                row = replace(attention, probs=attention.probs[:, p:p + 1])  # the heads' query row p only
                mixed = row.head_values(x.to(g)[None])  # (1, heads, 1, hd)
                u = row.head_cotangents(g[:, None])  # (K, heads, 1, hd)
                out[:, layer] = (u * mixed).sum((-1, -2)).cpu().double().numpy()
            del attention, row, pull  # they hold the layer's widened weights: not while the next one is widened
    return out


def _check(vectors: torch.Tensor, layer_inputs: Mapping[int, torch.Tensor], n_layers: int, n: int, d: int) -> None:
    """Refuse target vectors or layer inputs of the wrong shape, or inputs of layers the model does not have."""
    if vectors.ndim != 2 or vectors.shape[1] != d:
        raise InvalidArgumentError(f"Expected target vectors of shape (K, {d}). Got {tuple(vectors.shape)} instead.")
    for layer, x in layer_inputs.items():
        if not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise InvalidArgumentError(f"Expected layer inputs keyed by layers 0 to {n_layers - 1}. Got {layer!r} "
                                       "instead.")
        if tuple(x.shape) != (n, d):
            raise InvalidArgumentError(f"Expected layer {layer}'s input of shape ({n}, {d}). Got {tuple(x.shape)} "
                                       "instead.")
