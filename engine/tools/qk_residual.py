"""The residual stream at a layer's input as the sum of its components, each an exact quantity of the prompt's forward
pass (:mod:`detjac.engine.tools.qk`; definitions: docs/graphs.md, "Why a head attends where it does").

The layers below come from the frozen pieces the engine records (:func:`~detjac.engine.inmemory.model_pieces.
freeze_model`): each attention block's value path with its probabilities, norms and output projection folded in, so
head ``h``'s output is ``W_o,h P_h V_kv(h)`` (a norm after the attention, Gemma's and OLMo 2's, is in ``P``'s rows and
``W_o``); each MLP's neurons ``z`` (the graph's neurons) and what each writes; an affine family's constants of each
layer (the graph's bias nodes, with the neurons held).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from detjac.errors import InvalidArgumentError, UnsupportedModelError

from ..pieces.layer import Attention


@dataclass
class Components:
    """Residual-stream components at every position: ``vectors[c, p]`` is component ``c`` at position ``p`` and
    ``names[c][p]`` its name there (a neuron slot names a different neuron at each position)."""

    vectors: torch.Tensor  # (C, n, d)
    names: list[list[str]]  # (C, n)

    def total(self) -> torch.Tensor:
        """(n, d) their sum."""
        return self.vectors.sum(0)


def mlp_parts(mlp: Any, mid: torch.Tensor, neurons: int, layer: int) -> tuple[torch.Tensor, list[list[str]]]:
    """The MLP of ``layer`` on its input ``mid`` (n, d) as (parts (P, n, d), names (P, n)): ``M{layer}`` whole, or
    with ``neurons`` K > 0 its K neurons writing the most at each position (by ``|z_{p,i}| · |w_{p,i}|``, the norm
    of what neuron i writes there), named ``M{layer}.{i}``, and ``M{layer}.rest``, the other neurons' output."""
    z = mlp.activations(mid)  # (n, n_neurons)
    n, width = z.shape
    if neurons == 0:
        return mlp.output(z)[None], [[f"M{layer}"] * n]
    if neurons > width:
        raise InvalidArgumentError(f"Expected neurons from 0 to {width} (the neurons of layer {layer}'s MLP). "
                                   f"Got {neurons}.")
    parts = z.new_zeros(neurons + 1, n, mid.shape[1])
    rest = z.clone()
    names: list[list[str]] = [[""] * n for _ in range(neurons)] + [[f"M{layer}.rest"] * n]
    for p in range(n):
        live = z[p].nonzero()[:, 0]  # a mixture of experts' neurons are zero where p is not routed to them
        writes = mlp.write_rows(torch.full_like(live, p), live) * z[p, live, None]  # (live, d): each one's write
        top = writes.norm(dim=-1).topk(min(neurons, live.numel())).indices
        parts[:top.numel(), p] = writes[top]
        rest[p, live[top]] = 0
        chosen = live[top].tolist()
        if len(chosen) < neurons:  # fewer neurons with a value than slots: zero ones fill the rest
            chosen += sorted(set(range(width)) - set(live.tolist()))[:neurons - len(chosen)]
        for k, i in enumerate(chosen):
            names[k][p] = f"M{layer}.{i}"
    parts[neurons] = mlp.output(rest)
    return parts, names


def residual_components(frozen: Any, inputs: list[torch.Tensor], embeddings: torch.Tensor, layer: int,
                        neurons: int) -> Components:
    """Layer ``layer``'s input, at every position, as ``E`` (the embeddings), ``B`` (what is added before the first
    layer: learned position embeddings), and for each layer ``l`` below it ``A{l}.{h}`` per head, ``M{l}`` (or its
    neurons, see :func:`mlp_parts`) and ``B{l}`` (an affine family's constants), from the pieces ``frozen``
    (a :class:`~detjac.engine.inmemory.model_pieces.FrozenModel`) and each layer's real input ``inputs[l]`` (n, d)."""
    n = embeddings.shape[0]
    parts: list[torch.Tensor] = [embeddings[None]]
    names: list[list[str]] = [["E"] * n]
    offset = inputs[0] - embeddings
    if bool(offset.any()):
        parts.append(offset[None])
        names.append(["B"] * n)
    for lay in range(layer):
        pieces = frozen.layers[lay].pieces()
        if not isinstance(pieces.attention, Attention) or pieces.attention_norm is not None:
            raise UnsupportedModelError(f"Expected layer {lay} to be a pre-norm layer with one attention block. Got "
                                        f"{type(pieces.attention).__name__}.")
        heads = pieces.attention.head_outputs(inputs[lay])
        parts.append(heads)
        names += [[f"A{lay}.{h}"] * n for h in range(heads.shape[0])]
        mlp, mlp_names = mlp_parts(pieces.mlp, frozen.mids[lay], neurons, lay)
        parts.append(mlp)
        names += mlp_names
        constants = getattr(pieces.mlp, "layer_bias", None)
        if frozen.layers[lay].offsets is not None:
            if constants is None:
                raise UnsupportedModelError(f"Expected layer {lay}'s constants from its MLP's pieces. Got none.")
            parts.append(constants[None])
            names.append([f"B{lay}"] * n)
    return Components(torch.cat(parts), names)
