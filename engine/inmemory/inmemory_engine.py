"""The in-memory engine: a loaded transformers model of any supported family behind the engine interface.

One linearized forward pass per prompt; its walk is the model's explicit pieces (the default,
:mod:`detjac.engine.inmemory.model_pieces`) or the autograd walk, its ``torch.func`` pullback (``sweeps="autograd"``,
the ordinary Jacobian, and the fallback: :class:`~detjac.engine.inmemory.rows.AutogradWalk`), which the sweeps of
:mod:`detjac.engine.sweeps` cross. Only the ``output`` target. Details: docs/engine.md, "The row-block engine"."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from detjac.errors import InvalidArgumentError

from ..checkpoints.loading import get_tokenizer
from ..cost import CostModel
from ..families import family_for
from ..interface import Engine
from ..pieces.runner import chosen_sweeps
from ..products.decode import model_decoding_matrices
from ..products.logits import output_logits
from ..types import EngineStats, Plan, Prompt, Trace
from .model_pieces import FrozenModel
from .rows import AutogradWalk, InMemoryTrace, trace_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FORWARD_MODES = ("transpose", "jvp")


class InMemoryEngine(Engine):
    """A loaded model behind the :class:`~detjac.engine.interface.Engine` interface.

    Parameters
    ----------
    model
        A loaded model of a supported family (:func:`~detjac.engine.load_model`).
    detach
        Detached Jacobians (default) or ordinary ones.
    tokenizer
        Default: the one :func:`~detjac.engine.load_model` attached.
    forward
        How :meth:`push` computes ``J v``: ``"transpose"`` (default), the pullback of the kept
        pullback, which runs the backward graph backwards through exactly the linear path; or
        ``"jvp"``, forward mode through the linearized model (measured 1.2-1.3x the time of
        ``"transpose"`` for 32 columns of a float64 d_model 512, 4-layer Llama at 64 and 256
        tokens, with identical products).
    convention
        The family's detach convention (:attr:`~detjac.engine.families.Family.conventions`); None: its default.
    sweeps
        ``"explicit"`` (the model's frozen pieces as plain matmuls) or ``"autograd"`` (``torch.func``, the
        reference; ``forward`` applies to it only); default: the ``DETJAC_SWEEPS`` environment variable, else
        ``"explicit"`` (see the module docstring).

    Raises
    ------
    InvalidArgumentError
        A bad ``forward`` or ``sweeps``, or a convention the family lacks.
    """

    def __init__(self, model: PreTrainedModel, *, detach: bool = True, tokenizer: Any | None = None,
                 forward: str = "transpose", convention: str | None = None, sweeps: str | None = None) -> None:
        if forward not in FORWARD_MODES:
            raise InvalidArgumentError(f"Expected forward one of {', '.join(FORWARD_MODES)}. Got {forward!r}.")
        self.model, self.detach, self.forward = model, detach, forward
        self.config = model.config
        self.family = family_for(model.config)
        self.convention = self.family.check_convention(convention)
        self.sweeps = chosen_sweeps(sweeps)
        self._warned = False
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device
        text = model.config.get_text_config()
        self.n_layers, self.d_model = int(text.num_hidden_layers), int(text.hidden_size)
        self.stats = EngineStats()
        self.model_ref: Any = None  # the ModelRef load_engine loaded it from (what print(engine) names)
        self.tokenizer = tokenizer if tokenizer is not None else get_tokenizer(model)

    @property
    def explicit_sweeps(self) -> bool:
        return self.sweeps == "explicit"

    def trace(self, prompt: Prompt, *, position: int | None = None, progress: bool = False) -> InMemoryTrace:
        """The linearized forward pass, its pieces (explicit) or its pullback (autograd) kept (and, for an affine
        family, the offset ``b``); the first fallback from explicit to autograd warns."""
        t = trace_model(self.model, prompt, detach=self.detach, position=position, tokenizer=self.tokenizer,
                        convention=self.convention, sweeps=self.sweeps, warn=not self._warned)
        self._warned = self._warned or t.fallback is not None  # said once per engine
        if t.frozen is not None:
            t.frozen.stats = self.stats
        return t

    def cost_model(self, trace: Trace) -> CostModel:
        """The cost model of this engine's sweeps on ``trace`` (the weights are held already: no layer to read), whose
        plan sizes the row block when none is given: all d rows in one block where the MLPs fold and the block fits
        the memory this machine has free, else as many as fit (:meth:`~detjac.engine.cost.CostModel.plan`,
        the layer-streamed engine's rule without a budget)."""
        explicit = isinstance(trace, InMemoryTrace) and trace.frozen is not None
        return CostModel.of(self.model.config, trace.embeddings.element_size(), 0, detach=self.detach,
                            sweeps="explicit" if explicit else "autograd")

    @contextmanager
    def walk(self, trace: Trace, plan: Plan | None = None) -> Iterator[FrozenModel | AutogradWalk]:
        """The trace's frozen pieces of the whole model (explicit sweeps), else the autograd walk (its ``torch.func``
        pullback, which honours the output's cotangents read at the embeddings)."""
        t: InMemoryTrace = InMemoryTrace.own(trace, "in-memory")
        with torch.no_grad():
            yield t.frozen if t.frozen is not None else AutogradWalk(t, self)

    def decoding_matrices(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The model's own matrices (an encoder's left vectors decode through its word embeddings)."""
        return model_decoding_matrices(self.model, dtype or self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return output_logits(self.model, hidden)

    def stock_logits(self, token_ids: Sequence[int], position: int) -> torch.Tensor:
        ids = torch.tensor([list(token_ids)], device=self.device)
        with torch.no_grad():
            if self.family.encoder:  # no LM head: the final hidden state scored against the word embeddings
                return output_logits(self.model, self.model(ids, use_cache=False).last_hidden_state[0, position])
            return self.model(ids, use_cache=False).logits[0, position]
