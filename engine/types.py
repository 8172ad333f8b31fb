"""The data an engine hands out: a prompt's :class:`Trace`, a :class:`Plan` of how a request is computed, its
:class:`JacobianBlock` objects, and :class:`EngineStats` for memory accounting (docs/engine.md, "Two engines, one
interface")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from detjac.errors import InvalidArgumentError
from detjac.targets import Target

Prompt = str | Sequence[int] | torch.Tensor
"""Text (tokenized with the model's tokenizer, special tokens added) or token ids."""


@dataclass
class Trace:
    """The forward pass of one prompt: what the Jacobians act on and what they must reconstruct.

    Attributes
    ----------
    token_ids : list[int]
        The prompt's tokens (n_tokens).
    position : int
        The target position (non-negative).
    embeddings : torch.Tensor
        (n_tokens, d_model) the input embeddings ``x``.
    output : torch.Tensor
        (d_model,) the final normed hidden state at ``position``.
    bias : torch.Tensor or None
        (d_model,) the offset ``b`` of an affine family's map ``y = sum_k J_k x_k + b``; None otherwise.
    """

    token_ids: list[int]
    position: int
    embeddings: torch.Tensor
    output: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def own(cls, trace: Trace, engine: str) -> Any:
        """``trace`` where it is of this class (``engine``'s own trace), else refused naming ``engine``.

        Raises
        ------
        InvalidArgumentError
            A trace of another engine.
        """
        if not isinstance(trace, cls):
            raise InvalidArgumentError(f"Expected a trace from the {engine} engine's own trace(). Got a "
                                       f"{type(trace).__name__}.")
        return trace

    def value(self, t: Target) -> torch.Tensor:
        """(d_model,) the target's value at the position: what its Jacobian reconstructs (less ``bias``)."""
        if t.is_output:
            return self.output
        raise KeyError(f"Expected the output target of a trace without layer states. Got {t.name!r}.")

    def source(self, t: Target) -> torch.Tensor:
        """(n_tokens, d_model) the vectors the target's Jacobian acts on: the input embeddings."""
        if t.is_output or not t.local:
            return self.embeddings
        raise KeyError(f"Expected a target w.r.t. the input embeddings. Got {t.name!r}.")


@dataclass(frozen=True)
class JacobianBlock:
    """Rows ``start:stop`` and tokens ``token_start:token_stop`` of one target's Jacobian.

    ``values`` has shape (stop - start, token_stop - token_start, d_model).
    """

    target: Target
    start: int
    stop: int
    token_start: int
    token_stop: int
    values: torch.Tensor


@dataclass
class Plan:
    """How one request is computed: which targets go which way, in blocks of what size."""

    reverse: list[Target]
    forward: list[Target]
    row_block: int
    token_block: int
    reverse_cost: float = 0.0
    forward_cost: float = 0.0
    n_row_blocks: int = 0
    n_token_blocks: int = 0
    widen: str = "layer"  # the layer in use widened whole ("layer") or a matrix at a time ("matrix"): CostModel

    @property
    def n_blocks(self) -> int:
        return self.n_row_blocks + self.n_token_blocks

    def mode(self, t: Target) -> str:
        """``"forward"`` or ``"reverse"``: how target ``t`` is computed."""
        return "forward" if t in self.forward else "reverse"


@dataclass
class EngineStats:
    """What an engine has read and run, for memory accounting (checked by the tests)."""

    layers_loaded: int = 0
    max_resident_layers: int = 0
    resident: set[int] = field(default_factory=set)
    bytes_read: int = 0
    suffix_layers: int = 0  # forward-mode layer sweeps run on a suffix of the positions (causal truncation)
    pulled_suffix_layers: int = 0  # reverse-mode layer pullbacks from the outputs of a suffix of the positions
    explicit_layers: int = 0  # layer sweeps by explicit matmuls (detjac.engine.streamed.adjoint), not torch.func
    # reading ahead (detjac.engine.streamed.prefetch): seconds the engine waited on weights; loads served by a read
    # started ahead, by a layer kept from an earlier pass; reads started ahead and not used; most layers held at once
    weight_wait_seconds: float = 0.0
    layers_prefetched: int = 0
    layers_kept: int = 0
    layers_read_unused: int = 0
    max_layers_held: int = 0
    matrices_widened: int = 0  # matrices widened just before their use (layers widened a matrix at a time)
