"""Steering generation with a concept prompt's layerwise detached Jacobians.

The detached Jacobians ``J_1 ... J_n`` of layer ℓ's output (at the last position) for a
concept prompt are an exact linear system: ``h_ℓ = Σ_k J_k x_k`` over the concept's input
embeddings. Applied to another prompt's embeddings, the same operators map that text
through the concept prompt's frozen computation, into the directions layer ℓ used for the
concept. Steering adds that, scaled, to the hidden state at layer ℓ:

    v_j = Σ_{i=0}^{n-1} J_{n-i} x'_{j-i}          (operators aligned at the end, like a filter)
    h_ℓ[j] <- h_ℓ[j] + λ ||h_ℓ[j]|| v_j / ||v_j||

for every position j of the new sequence (prompt and generated tokens alike) except the
first, which in most models holds the attention sink; positions before the start of the
sequence contribute nothing (``x'_{j-i}`` with ``j - i < 0`` is skipped). λ is relative to
the hidden state's norm, so one value means the same at any layer and for any model. With
``λ = 0`` generation is exactly the unsteered model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from detjac.errors import InvalidArgumentError

from .families import family_for


@dataclass
class SteeringOperator:
    """A concept prompt's layer-``layer`` Jacobians ``operators`` (n_concept, d, d): operator k maps token k."""

    layer: int
    operators: torch.Tensor
    concept: str = ""

    @classmethod
    def from_jacobian(cls, layer: int, jacobian: Any, concept: str = "") -> SteeringOperator:
        """From a stored layerwise Jacobian (rows, token, cols) of the target ``layer.<layer>``."""
        J = torch.as_tensor(jacobian)
        if J.ndim != 3 or J.shape[0] != J.shape[2]:
            raise InvalidArgumentError(f"Expected a layer Jacobian of shape (d, n_tokens, d). Got {tuple(J.shape)}.")
        return cls(layer, J.permute(1, 0, 2).contiguous(), concept)

    def vectors(self, embeddings: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``v_j`` for positions ``start ..`` of a sequence with input ``embeddings`` (m, d): (m - start, d)."""
        n, m = self.operators.shape[0], embeddings.shape[0]
        ops = self.operators.to(embeddings.dtype)
        out = embeddings.new_zeros(m - start, embeddings.shape[1])
        for i in range(min(n, m)):  # operator n-1-i acts on the token i positions back
            first = max(start, i)
            if first < m:
                out[first - start:] += embeddings[first - i:m - i] @ ops[n - 1 - i].T
        return out


class _Hooks:
    """Records the input embeddings as they are computed and adds the steering at the layer's output."""

    def __init__(self, op: SteeringOperator, strength: float) -> None:
        self.op, self.strength = op, strength
        self.embeddings: list[torch.Tensor] = []

    def on_embedding(self, module: Any, args: Any, output: torch.Tensor) -> None:
        if output.shape[0] != 1:
            raise InvalidArgumentError(f"Expected one sequence at a time when steering. Got a batch of "
                                       f"{output.shape[0]}.")
        self.embeddings.append(output[0].detach())

    def on_layer(self, module: Any, args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output  # (1, s, d)
        x = torch.cat(self.embeddings)  # (m, d): the sequence so far, this call's tokens included
        s, m = hidden.shape[1], x.shape[0]
        v = self.op.vectors(x.to(hidden.dtype), m - s)  # (s, d)
        norms = v.norm(dim=-1, keepdim=True)
        scale = self.strength * hidden[0].norm(dim=-1, keepdim=True) / torch.where(norms > 0, norms, 1.0)
        if m - s == 0:  # the first position (attention sink) is left alone
            scale[0] = 0.0
        steered = hidden + (scale * v)[None]
        return (steered, *output[1:]) if isinstance(output, tuple) else steered


@contextlib.contextmanager
def steering(model: Any, op: SteeringOperator, strength: float) -> Iterator[None]:
    """Within the block, ``model``'s forward passes (one sequence at a time) are steered by ``op``."""
    decoder = family_for(model.config).decoder(model)
    layers = decoder.layers
    if not 0 <= op.layer < len(layers):
        raise InvalidArgumentError(f"Expected a layer in [0, {len(layers)}). Got {op.layer}.")
    d = model.config.get_text_config().hidden_size
    if op.operators.shape[1:] != (d, d):
        raise InvalidArgumentError(f"Expected steering operators of shape (n, {d}, {d}) for this model. "
                                   f"Got {tuple(op.operators.shape)}: the concept store is from another model.")
    hooks = _Hooks(op, float(strength))
    handles = [decoder.get_input_embeddings().register_forward_hook(hooks.on_embedding),
               layers[op.layer].register_forward_hook(hooks.on_layer)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def generate(model: Any, ids: Sequence[int], max_new_tokens: int = 24, op: SteeringOperator | None = None,
             strength: float = 0.0) -> list[int]:
    """Greedy continuation of ``ids`` (new token ids only), steered by ``op`` at ``strength`` when given."""
    input_ids = torch.tensor([list(ids)], device=model.device)
    context = steering(model, op, strength) if op is not None else contextlib.nullcontext()
    with context, torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=model.config.pad_token_id or 0)
    return out[0, input_ids.shape[1]:].tolist()


def evaluate(model: Any, tokenizer: Any, op: SteeringOperator, prompts: Sequence[str], strengths: Sequence[float],
             concept_ids: set[int], max_new_tokens: int = 24, progress: bool = False) -> list[dict[str, Any]]:
    """How often the concept's tokens appear in steered continuations, per strength (0: unsteered).

    One row per strength: ``share_with_concept`` (continuations with at least one concept
    token), ``concept_per_continuation`` (their mean count), ``distinct_share`` (distinct
    tokens / tokens, a repetition check) and ``examples`` (the first continuation).
    """
    if not concept_ids:
        raise InvalidArgumentError("Expected at least one concept token to count. Got none.")
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    runs = [(s, ids) for s in strengths for ids in encoded]
    if progress:
        from detjac.progress import tqdm

        runs = tqdm(runs, desc="steered generations", unit="gen")
    outs: dict[float, list[list[int]]] = {float(s): [] for s in strengths}
    for strength, ids in runs:
        outs[float(strength)].append(generate(model, ids, max_new_tokens, op, strength))
    rows = []
    for strength, conts in outs.items():
        counts = [sum(t in concept_ids for t in c) for c in conts]
        rows.append({"strength": strength, "prompts": len(conts),
                     "share_with_concept": sum(c > 0 for c in counts) / len(conts),
                     "concept_per_continuation": sum(counts) / len(conts),
                     "distinct_share": sum(len(set(c)) / max(1, len(c)) for c in conts) / len(conts),
                     "example": tokenizer.decode(conts[0])})
    return rows
