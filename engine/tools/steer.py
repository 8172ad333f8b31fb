"""Steering generation with a concept prompt's layerwise detached Jacobians: two methods (:data:`METHODS`).

``detjac`` (the default) adds the ``layer.ℓ`` operators' image of the new text to layer ℓ's output; ``paper`` (the
reference implementation's) adds the ``layer_normed.ℓ`` operators' cumulative image to layer ℓ's input. Formulas:
docs/engine.md, "Steering"."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from detjac.errors import InvalidArgumentError

from ..families import family_for

METHODS = ("detjac", "paper")


@dataclass
class SteeringOperator:
    """A concept prompt's layer-``layer`` Jacobians ``operators`` (n_concept, d, d): operator k maps token k.

    ``method`` says how they are applied (see the module docstring): ``detjac`` or ``paper``.
    """

    layer: int
    operators: torch.Tensor
    concept: str = ""
    method: str = "detjac"

    def __post_init__(self) -> None:
        self.check_method(self.method)

    @staticmethod
    def check_method(method: str) -> str:
        """``method`` if it is one of :data:`METHODS`, else an :class:`InvalidArgumentError` naming them."""
        if method not in METHODS:
            raise InvalidArgumentError(f"Expected a steering method among {', '.join(METHODS)}. Got {method!r}.")
        return method

    @classmethod
    def from_jacobian(cls, layer: int, jacobian: Any, concept: str = "", method: str = "detjac") -> SteeringOperator:
        """From a stored layerwise Jacobian (rows, token, cols) of the target ``layer.<layer>`` (``detjac``) or
        ``layer_normed.<layer>`` (``paper``)."""
        J = torch.as_tensor(jacobian)
        if J.ndim != 3 or J.shape[0] != J.shape[2]:
            raise InvalidArgumentError(f"Expected a layer Jacobian of shape (d, n_tokens, d). Got {tuple(J.shape)}.")
        return cls(layer, J.permute(1, 0, 2).contiguous(), concept, method)

    def vectors(self, embeddings: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The un-scaled vectors added at positions ``start ..`` of a sequence with input ``embeddings`` (m, d):
        ``v_j`` (``detjac``) or ``a_i`` (``paper``), (m - start, d)."""
        if self.method == "paper":
            return self._cumulative(embeddings)[start:]
        n, m = self.operators.shape[0], embeddings.shape[0]
        ops = self.operators.to(embeddings.dtype)
        out = embeddings.new_zeros(m - start, embeddings.shape[1])
        for i in range(min(n, m)):  # operator n-1-i acts on the token i positions back
            first = max(start, i)
            if first < m:
                out[first - start:] += embeddings[first - i:m - i] @ ops[n - 1 - i].T
        return out

    def _cumulative(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``a_i = Σ_{k<=i} J_{k mod n} x'_k`` for every position i of ``embeddings`` (m, d): (m, d)."""
        n, m = self.operators.shape[0], embeddings.shape[0]
        ops = self.operators.to(embeddings.dtype)[torch.arange(m) % n]  # (m, d, d): operator k mod n for token k
        return torch.cumsum(torch.einsum("krc,kc->kr", ops, embeddings), dim=0)

    def added(self, hidden: torch.Tensor, embeddings: torch.Tensor, strength: float) -> torch.Tensor:
        """What the method adds to ``hidden`` (s, d), the last s positions of a sequence whose input embeddings so
        far are ``embeddings`` (m, d): (s, d)."""
        s, m = hidden.shape[0], embeddings.shape[0]
        v = self.vectors(embeddings.to(hidden.dtype), m - s)  # (s, d)
        norms = v.norm(dim=-1, keepdim=True)
        half = 0.5 if self.method == "paper" else 1.0
        scale = strength * half * hidden.norm(dim=-1, keepdim=True) / torch.where(norms > 0, norms, 1.0)
        if self.method == "detjac" and m - s == 0:  # the first position (attention sink) is left alone
            scale[0] = 0.0
        return scale * v


class _Hooks:
    """Records the input embeddings as they are computed and adds the steering at the layer's output (``detjac``)
    or input (``paper``)."""

    def __init__(self, op: SteeringOperator, strength: float) -> None:
        self.op, self.strength = op, strength
        self.embeddings: list[torch.Tensor] = []

    def on_embedding(self, module: Any, args: Any, output: torch.Tensor) -> None:
        if output.shape[0] != 1:
            raise InvalidArgumentError(f"Expected one sequence at a time when steering. Got a batch of "
                                       f"{output.shape[0]}.")
        self.embeddings.append(output[0].detach())

    def _steered(self, hidden: torch.Tensor) -> torch.Tensor:  # (1, s, d) -> (1, s, d)
        return hidden + self.op.added(hidden[0], torch.cat(self.embeddings), self.strength)[None]

    def on_layer(self, module: Any, args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output  # (1, s, d)
        steered = self._steered(hidden)
        return (steered, *output[1:]) if isinstance(output, tuple) else steered

    def on_layer_input(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (self._steered(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._steered(kwargs["hidden_states"])}


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
    layer = layers[op.layer]
    handles = [decoder.get_input_embeddings().register_forward_hook(hooks.on_embedding),
               layer.register_forward_pre_hook(hooks.on_layer_input, with_kwargs=True) if op.method == "paper"
               else layer.register_forward_hook(hooks.on_layer)]
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
