"""The in-memory engine's trace: one (linearized) forward pass of a loaded model, :func:`trace_model`.

The trace keeps what the sweeps need: the model's frozen pieces (the explicit sweeps) or a ``torch.func`` pullback
(the autograd sweeps, the ordinary Jacobian, and the fallback for a piece without an explicit rule); an affine
family's offset ``b`` comes from a replay on zero inputs (:mod:`detjac.engine.detach.factors`). Details:
docs/engine.md, "The row-block engine"."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from detjac.errors import InvalidArgumentError

from ..checkpoints.loading import parse_prompt
from ..detach.factors import FactorTape
from ..detach.model import linearized
from ..families import family_for
from ..pieces import NotAPiece
from ..pieces.runner import chosen_sweeps
from ..types import Trace
from .model_pieces import FrozenModel, freeze_model


@dataclass
class InMemoryTrace(Trace):
    """A :class:`~detjac.engine.types.Trace` of a loaded model: its frozen pieces (explicit sweeps) or its
    ``torch.func`` pullback (autograd sweeps), and why the explicit sweeps were asked for and not taken."""

    frozen: FrozenModel | None = field(default=None, repr=False)
    pullback: Any = field(default=None, repr=False)  # u -> (u J,): the autograd sweeps' pullback
    fallback: str | None = None
    transpose: Any = field(default=None, repr=False)  # v -> J v, the pullback of the pullback (built on demand)


def prompt_position(model: PreTrainedModel, prompt: str | Sequence[int] | torch.Tensor, position: int | None,
                    tokenizer: Any | None) -> tuple[list[int], int]:
    """The prompt's token ids and the target position (None: the family's default), checked.

    Raises
    ------
    PromptError
        Empty prompt, unknown token ids, or more tokens than the model's context.
    InvalidArgumentError
        ``position`` outside the prompt.
    """
    ids = parse_prompt(prompt, model, tokenizer)
    if position is None:
        position = family_for(model.config).default_position
    if not -len(ids) <= position < len(ids):
        raise InvalidArgumentError(f"Expected a position in [-{len(ids)}, {len(ids)}). Got {position} instead.")
    return ids, position


def trace_model(model: PreTrainedModel, prompt: str | Sequence[int] | torch.Tensor, *, detach: bool = True,
                position: int | None = None, tokenizer: Any | None = None, convention: str | None = None,
                sweeps: str | None = None, warn: bool = True) -> InMemoryTrace:
    """Run the (linearized) forward pass of ``prompt`` and keep what its Jacobian's sweeps need: the arguments as
    :class:`~detjac.engine.InMemoryEngine` and its :meth:`~detjac.engine.Engine.trace` take them (the ordinary
    Jacobian is always autograd); ``warn``: warn (``RuntimeWarning``) when the explicit sweeps fall back to
    ``torch.func`` (the reason is kept in ``fallback`` either way).

    Raises
    ------
    PromptError, InvalidArgumentError, UnsupportedModelError
        As the engine's trace raises them; a module without a detach rule.
    """
    ids, position = prompt_position(model, prompt, position, tokenizer)
    at = position % len(ids)
    explicit = detach and chosen_sweeps(sweeps) == "explicit"
    fallback = None
    with linearized(model, detach=detach, convention=convention) as lin:
        device = next(model.parameters()).device
        input_ids = torch.tensor([ids], device=device)
        embeddings = lin.decoder.get_input_embeddings()(input_ids)[0].detach()  # (n, d)
        if explicit:
            try:
                frozen, output, bias = freeze_model(lin, embeddings, at)
            except NotAPiece as e:
                fallback = str(e)
            else:
                return InMemoryTrace(ids, at, embeddings, output, bias, frozen=frozen)
            if warn:
                warnings.warn(f"{lin.family.name} {fallback}; its sweeps go through torch.func (the autograd sweeps) "
                              "instead of explicit matmuls.", RuntimeWarning, stacklevel=2)

        affine = detach and lin.family.affine

        def target(x: torch.Tensor) -> torch.Tensor:  # (n, d) -> (d,)
            return lin.decoder(inputs_embeds=x[None], use_cache=False).last_hidden_state[0, position]

        def forward(x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            if not affine:  # a linear map: b = 0, nothing to record
                return target(x), ()
            tape = FactorTape()
            with tape.recording():
                y = target(x)
            with tape.replaying_factors():  # the factors of x, on zero inputs: only the offsets remain
                bias = target(torch.zeros_like(x))
            return y, (bias.detach(),)

        output, pullback, aux = torch.func.vjp(forward, embeddings, has_aux=True)
    return InMemoryTrace(ids, at, embeddings, output.detach(), aux[0] if aux else None, pullback=pullback,
                         fallback=fallback)


class AutogradWalk:
    """The autograd walk: the whole model crossed at once by the trace's ``torch.func`` pullback, a
    :class:`~detjac.engine.pullback.Walk` with no layer of its own (the sweep goes from the output straight to the
    embeddings). It honours the output's cotangents read at the embeddings, and nothing inside the model.

    ``engine``: the in-memory engine whose trace it is (its model, ``detach``, convention, and ``forward``: how
    :meth:`push` computes ``J v``)."""

    n_layers = 0

    def __init__(self, trace: InMemoryTrace, engine: Any) -> None:
        self.trace, self.engine, self.n_tokens = trace, engine, trace.n_tokens

    def supports(self, request: Any) -> str | None:
        from ..pullback import EMBEDDINGS, OUTPUT

        if any(s.site != OUTPUT for s in request.seeds) or set(request.reads) != {EMBEDDINGS} or request.cut:
            return (f"its sweeps go through torch.func ({self.trace.fallback or 'chosen'}), which honours the output's "
                    f"cotangents read at the embeddings; got seeds at {', '.join(s.site.name for s in request.seeds)}"
                    f" read at {', '.join(r.name for r in request.reads)}")
        return None

    def final(self, seed: Any) -> torch.Tensor:
        """(B, d) cotangents of the output -> (B, n, d) at the embeddings: the whole model's pullback."""
        # torch.func pullbacks build a graph of the backward itself (for higher-order transforms) unless grad mode
        # is off; that graph would keep every intermediate cotangent of the block alive (3x the peak memory at
        # d_model=512).
        with torch.no_grad():
            return torch.func.vmap(self.trace.pullback)(seed.values)[0]

    def layer(self, i: int) -> Any:
        """Refused by name: the sweep never enters a layer of this walk, and what asks for one needs explicit
        pieces (neurons, heads)."""
        raise InvalidArgumentError(f"Expected a trace with the model's explicit pieces for layer {i}. Got one whose "
                                   f"sweeps went through torch.func: {self.trace.fallback or 'chosen'}.")

    def embed(self, g: torch.Tensor) -> torch.Tensor:
        return g  # final() already reached the embeddings

    def enter(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def residual_ends(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise InvalidArgumentError("Expected a trace with the model's explicit pieces for the residual stream's ends. "
                                   f"Got one whose sweeps went through torch.func: {self.trace.fallback or 'chosen'}.")

    def push(self, tangents: torch.Tensor) -> torch.Tensor:
        """``J v``: (c, n, d) -> (c, d), by the transposed pullback (``forward="transpose"``: the pullback of the
        kept pullback, any point will do as it is linear in its cotangent) or forward mode (``"jvp"``)."""
        t = self.trace
        if self.engine.forward == "jvp":
            return self._jvp(tangents)
        if t.transpose is None:
            pullback = t.pullback
            with torch.enable_grad():
                _, t.transpose = torch.func.vjp(lambda u: pullback(u)[0], torch.zeros_like(t.output))
        with torch.no_grad():
            return torch.func.vmap(t.transpose)(tangents)[0]

    def _jvp(self, tangents: torch.Tensor) -> torch.Tensor:
        e, x, p = self.engine, self.trace.embeddings, self.trace.position
        with linearized(e.model, detach=e.detach, convention=e.convention) as lin, torch.no_grad():
            def target(v: torch.Tensor) -> torch.Tensor:  # (n, d) -> (d,)
                return lin.decoder(inputs_embeds=v[None], use_cache=False).last_hidden_state[0, p]

            return torch.func.vmap(lambda v: torch.func.jvp(target, (x,), (v,))[1])(tangents)
