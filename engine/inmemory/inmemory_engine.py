"""The in-memory engine: a loaded transformers model of any supported family behind the engine interface.

One linearized forward pass per prompt; rows, ``J^T u`` and ``J v`` by its explicit pieces (the default,
:mod:`detjac.engine.inmemory.model_pieces`) or by ``torch.func`` (``sweeps="autograd"``, and the fallback). Only the
``output`` target. Details: docs/engine.md, "The row-block engine"."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from detjac.errors import InvalidArgumentError
from detjac.targets import OUTPUTS, Target

from ..checkpoints.loading import get_tokenizer
from ..cost import MODES, CostModel, check_request
from ..detach.model import linearized
from ..families import family_for
from ..interface import Engine
from ..pieces.runner import chosen_sweeps
from ..products.decode import model_decoding_matrices
from ..products.logits import output_logits
from ..pullback import EMBEDDINGS, PullRequest, Site, check_pull
from ..pullback import OUTPUT as OUTPUT_SITE
from ..types import EngineStats, JacobianBlock, Plan, Prompt, Trace
from .model_pieces import FrozenModel
from .rows import InMemoryTrace, pull, trace_model

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

    def plan(self, trace: Trace, targets: Sequence[Target], *, mode: str = "auto", row_block: int | None = None,
             token_block: int | None = None) -> Plan:
        """Row blocks of the output's Jacobian (reverse mode: the only one this engine has)."""
        if mode not in MODES or mode == "forward":
            raise InvalidArgumentError(f"Expected mode auto or reverse for the in-memory engine. Got {mode!r}.")
        others = [t.name for t in targets if not t.is_output]
        if others:
            raise InvalidArgumentError(
                f"Expected only the 'output' target from the in-memory engine. Got {', '.join(others)}: layerwise "
                "targets need the layer-streamed engine (detjac run --layers, or StreamedEngine)."
            )
        check_request("reverse", row_block, token_block)
        rows = row_block or self._cost(trace).plan(trace.n_tokens, [OUTPUTS], mode="reverse").row_block
        return Plan([OUTPUTS] if targets else [], [], rows, 1, float(self.d_model), 0.0,
                    -(-self.d_model // rows) if targets else 0, 0)

    def _cost(self, trace: Trace) -> CostModel:
        """The cost model of this engine's sweeps on ``trace`` (the weights are held already: no layer to read), whose
        plan sizes the row block when none is given: all d rows in one block where the MLPs fold and the block fits
        the memory this machine has free, else as many as fit (:meth:`~detjac.engine.cost.CostModel.plan`,
        the layer-streamed engine's rule without a budget)."""
        explicit = isinstance(trace, InMemoryTrace) and trace.frozen is not None
        return CostModel.of(self.model.config, trace.embeddings.element_size(), 0, detach=self.detach,
                            sweeps="explicit" if explicit else "autograd")

    def blocks(self, trace: Trace, targets: Sequence[Target], plan: Plan | None = None, *,
               progress: bool = False) -> Iterator[JacobianBlock]:
        """Rows of the output's Jacobian, ``plan.row_block`` at a time, from vmapped basis pullbacks."""
        plan = plan if plan is not None else self.plan(trace, targets)
        if not plan.reverse:
            return
        from detjac.progress import progress_bar

        t, d = _in_memory(trace), self.d_model
        eye = torch.eye(d, dtype=t.output.dtype, device=t.output.device)
        starts = range(0, d, plan.row_block)
        for start in progress_bar(starts, progress, "row blocks", "block", total=plan.n_row_blocks):
            stop = min(start + plan.row_block, d)
            yield JacobianBlock(OUTPUTS, start, stop, 0, t.n_tokens, pull(t, eye[start:stop]))

    @contextmanager
    def walk(self, trace: Trace) -> Iterator[FrozenModel]:
        """The trace's frozen pieces of the whole model (explicit sweeps), refused by name where there are none."""
        frozen = _in_memory(trace).frozen
        if frozen is None:
            raise InvalidArgumentError("Expected a trace with the model's explicit pieces. Got one whose sweeps went "
                                       f"through torch.func: {_in_memory(trace).fallback or 'chosen'}.")
        with torch.no_grad():
            yield frozen

    def pulls(self, trace: Trace, requests: Sequence[PullRequest]) -> Iterator[tuple[int, Site, torch.Tensor]]:
        """The walk's sweep (explicit sweeps); on the autograd path only the output's cotangents read at the
        embeddings, by the kept pullback."""
        t = _in_memory(trace)
        if t.frozen is not None:
            yield from super().pulls(trace, requests)
            return
        check_pull(requests, self.pullback_sites, self.detach)
        for j, request in enumerate(requests):
            if any(s.site != OUTPUT_SITE for s in request.seeds) or set(request.reads) != {EMBEDDINGS}:
                raise InvalidArgumentError(
                    "Expected the output's cotangents read at the embeddings from the in-memory engine's autograd "
                    f"sweeps ({t.fallback or 'chosen'}). Got seeds at "
                    f"{', '.join(s.site.name for s in request.seeds)} read at "
                    f"{', '.join(r.name for r in request.reads)}."
                )
            yield j, EMBEDDINGS, pull(t, torch.stack([s.values for s in request.seeds]).sum(0))

    def push(self, trace: Trace, tangents: torch.Tensor) -> torch.Tensor:
        """``J v``: (c, n, d) -> (c, d), by the transposed pullback or forward mode (see ``forward``)."""
        t = _in_memory(trace)
        if t.frozen is not None:
            return t.frozen.push(tangents)
        if self.forward == "jvp":
            return self._jvp(t, tangents)
        if t.transpose is None:  # any point will do: the pullback is linear in its cotangent
            pullback = t.pullback
            with torch.enable_grad():
                _, t.transpose = torch.func.vjp(lambda u: pullback(u)[0], torch.zeros_like(t.output))
        with torch.no_grad():
            return torch.func.vmap(t.transpose)(tangents)[0]

    def _jvp(self, trace: InMemoryTrace, tangents: torch.Tensor) -> torch.Tensor:
        x, p = trace.embeddings, trace.position
        with linearized(self.model, detach=self.detach, convention=self.convention) as lin, torch.no_grad():
            def target(e: torch.Tensor) -> torch.Tensor:  # (n, d) -> (d,)
                return lin.decoder(inputs_embeds=e[None], use_cache=False).last_hidden_state[0, p]

            return torch.func.vmap(lambda v: torch.func.jvp(target, (x,), (v,))[1])(tangents)

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


def _in_memory(trace: Trace) -> InMemoryTrace:
    if not isinstance(trace, InMemoryTrace):
        raise InvalidArgumentError(
            f"Expected a trace from the in-memory engine's own trace(). Got a {type(trace).__name__}."
        )
    return trace

