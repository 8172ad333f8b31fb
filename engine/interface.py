"""The engine interface: what only an engine can answer, so that no caller asks which one it holds.

:class:`Engine`, implemented by the in-memory and the layer-streamed engine, asks six things: :meth:`~Engine.trace` a
prompt, hand out its :meth:`~Engine.walk` (what the pullback primitive sweeps), map hidden states to
:meth:`~Engine.logits` and give the :meth:`~Engine.decoding_matrices`, the stock model's own
:meth:`~Engine.stock_logits` (the independent check), and its :meth:`~Engine.cost_model`. Blocks, plan and ``J v``
are written once over any walk (:mod:`detjac.engine.sweeps`; here as :meth:`~Engine.plan`, :meth:`~Engine.blocks`,
:meth:`~Engine.push`), and so are :meth:`~Engine.pulls` and :meth:`~Engine.pull`; other products are free functions
beside their users (:func:`detjac.engine.prompt_pass`, :mod:`detjac.engine.tools.neurons`,
:mod:`detjac.engine.tools.lens_pulls`). The data types are in :mod:`detjac.engine.types`. Details: docs/engine.md,
"Two engines, one interface"."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from detjac.targets import Target

from . import sweeps
from .cost import CostModel
from .products.decode import numpy_dtype
from .pullback import CUTS, EMBEDDINGS, OUTPUT, READ_KINDS, SEED_KINDS, PullRequest, Seed, Site, Walk, check_pull, pulls
from .types import EngineStats, JacobianBlock, Plan, Prompt, Trace


class Engine(ABC):
    """A loaded model that linearizes prompts: six abstract methods (see the module docstring), the rest derived.

    Attributes
    ----------
    model
        The transformers model: loaded whole, or (layer-streamed) a skeleton whose parameters live on the
        ``meta`` device; its parameters' shapes count the model's parameters either way.
    config
        The model's transformers config.
    family
        Its :class:`~detjac.engine.families.Family` (detach rules, quirks).
    dtype, device
        Compute dtype (float64 is the exactness mode) and device.
    detach : bool
        Detached Jacobians (True) or ordinary ones.
    convention : str
        The family's detach convention in use (:attr:`~detjac.engine.families.Family.conventions`).
    n_layers, d_model : int
        Decoder layers and hidden size.
    tokenizer
        The model's tokenizer, or None when the checkpoint has none (prompts must then be token ids).
    stats : EngineStats
        Layers read and run so far.
    layerwise : bool
        Whether it computes layer targets and forward mode (the layer-streamed engine), or the output's Jacobian in
        reverse mode only.
    """

    layerwise = False

    model: Any
    config: Any
    family: Any
    dtype: torch.dtype
    device: torch.device
    detach: bool
    convention: str
    n_layers: int
    d_model: int
    stats: EngineStats
    tokenizer: Any | None

    def __repr__(self) -> str:  # the model (as load_engine took it, else its config's path), family, dtype, ...
        ref, kind = getattr(self, "model_ref", None), "layer-streamed" if getattr(self, "streamed", 0) else "in memory"
        name = ref.name if ref is not None else getattr(self.config, "name_or_path", "") or "a loaded model"
        return (f"<{type(self).__name__} of {name!r}: {self.family.name}, {str(self.dtype).removeprefix('torch.')}, "
                f"{self.device}, {kind}, {'detached' if self.detach else 'ordinary'}, {self.n_layers} layers, "
                f"d_model {self.d_model}>")

    @property
    def context(self) -> int:
        """The model's context length in tokens (unbounded when its config does not say)."""
        return getattr(self.config.get_text_config(), "max_position_embeddings", None) or 2**31

    def prompt_model(self) -> Any:
        """What :func:`detjac.engine.parse_prompt` checks token ids against (vocabulary size, config)."""
        return self.model

    def token_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, checked against the model (:func:`detjac.engine.parse_prompt`)."""
        from .checkpoints.loading import parse_prompt

        return parse_prompt(prompt, self.prompt_model(), self.tokenizer)

    @abstractmethod
    def trace(self, prompt: Prompt, *, position: int | None = None, progress: bool = False) -> Trace:
        """Run the forward pass of ``prompt``; ``position`` defaults to the family's (the last token, or [CLS]).

        Raises
        ------
        PromptError
            An empty prompt, unknown token ids, or more tokens than the model's context.
        InvalidArgumentError
            ``position`` outside the prompt.
        """

    @abstractmethod
    def cost_model(self, trace: Trace) -> CostModel:
        """The cost model of this engine's sweeps on ``trace``: its shapes, bytes per number and per layer, memory
        budget (:class:`~detjac.engine.cost.CostModel`), which :meth:`plan` sizes the blocks by."""

    def plan(self, trace: Trace, targets: Sequence[Target], *, mode: str = "auto", row_block: int | None = None,
             token_block: int | None = None) -> Plan:
        """Split ``targets`` between reverse and forward mode and size the blocks (:func:`detjac.engine.sweeps.plan`).

        Raises
        ------
        InvalidArgumentError
            A target this engine cannot compute, an unknown mode, a non-positive block, or a memory budget
            too small for one block.
        """
        return sweeps.plan(self, trace, targets, mode=mode, row_block=row_block, token_block=token_block)

    def blocks(self, trace: Trace, targets: Sequence[Target], plan: Plan | None = None, *,
               progress: bool = False) -> Iterator[JacobianBlock]:
        """Every requested Jacobian, block by block, reverse mode first (:func:`detjac.engine.sweeps.blocks`)."""
        return sweeps.blocks(self, trace, targets, plan, progress=progress)

    # -- the pullback primitive (detjac.engine.pullback) ---------------------------------------

    @abstractmethod
    def walk(self, trace: Trace, plan: Plan | None = None) -> AbstractContextManager[Walk]:
        """The prompt's model as a :class:`~detjac.engine.pullback.Walk` (its final norm, its layers one at a time,
        what comes before them; ``push`` for ``J v``), for the duration of a ``with`` block; ``plan``: the blocks it
        will serve, when known (a budget's layers kept between them).

        Raises
        ------
        InvalidArgumentError
            A trace whose layers are not explicit pieces where the walk needs them.
        """

    @property
    def pullback_sites(self) -> frozenset[str]:
        """What :meth:`pulls` honours on this engine: seed kinds, read kinds (:data:`~detjac.engine.pullback.
        SEED_KINDS`, :data:`~detjac.engine.pullback.READ_KINDS`) and ``cut:mlp``. Explicit detached sweeps honour
        all; the autograd sweeps and the ordinary Jacobian have no neurons and no cut."""
        everything = {*SEED_KINDS, *READ_KINDS, *(f"cut:{c}" for c in CUTS)}
        if self.detach and self.explicit_sweeps:
            return frozenset(everything)
        return frozenset(everything - {"neurons", "cut:mlp"})

    @property
    def explicit_sweeps(self) -> bool:
        """Whether blocks cross the layers by their explicit pieces (else by ``torch.func``)."""
        return False

    def pulls(self, trace: Trace, requests: Sequence[PullRequest]) -> Iterator[tuple[int, Site, torch.Tensor]]:
        """Every read of every request as the sweep of :meth:`walk` reaches it: ``(request index, site, cotangents)``
        (:func:`detjac.engine.pullback.pulls`).

        Raises
        ------
        InvalidArgumentError
            A request this engine cannot honour (:attr:`pullback_sites`), or a malformed one.
        """
        check_pull(requests, self.pullback_sites, self.detach)
        with self.walk(trace) as walk:
            yield from pulls(walk, requests)

    def pull(self, trace: Trace, cotangents: torch.Tensor) -> torch.Tensor:
        """``J^T u`` of the output's Jacobian: (c, d_model) output directions -> (c, n_tokens, d_model)."""
        u = cotangents.to(device=self.device, dtype=self.dtype)
        read = {site: values for _, site, values in self.pulls(trace, [PullRequest((Seed(OUTPUT, u),), (EMBEDDINGS,))])}
        return read[EMBEDDINGS]

    def push(self, trace: Trace, tangents: torch.Tensor) -> torch.Tensor:
        """``J v`` of the output's Jacobian: (c, n_tokens, d_model) input directions -> (c, d_model)
        (:func:`detjac.engine.sweeps.push`)."""
        return sweeps.push(self, trace, tangents)

    @abstractmethod
    def decoding_matrices(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``embedding`` (vocab, d_model), ``unembedding`` (vocab, d_model) and, where the final norm has one,
        ``final_norm`` (d_model,) its gain; on the CPU, in ``dtype`` (default: the compute dtype)."""

    def decoding_rows(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The matrices of :meth:`decoding_matrices` for copying out in row blocks: numpy arrays, or
        :class:`~detjac.engine.products.decode.RowBlocks` read on demand where an engine has a memory budget to keep;
        a 16-bit ``dtype`` (default: the compute dtype) is widened to float32, which numpy holds."""
        return {k: v.numpy() for k, v in self.decoding_matrices(numpy_dtype(dtype or self.dtype)).items()}

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits (..., vocab) from final normed hidden states (..., d_model), as the model computes
        them (soft-capping included); scores against the word embeddings for an encoder without a head."""

    def memory_budget(self, device: str) -> int | None:
        """The memory budget in bytes given for ``device`` (``"cpu"``, ``"cuda:0"``), or None."""
        return None

    def sweep_memory(self, n_tokens: int) -> tuple[int | None, int]:
        """(bytes the compute device's budget leaves for pulled-back vectors at ``n_tokens`` once the engine's own
        needs are counted (a layer read in, the trace, a crossing's temporaries), or None without a budget; bytes
        one vector costs while it crosses a layer)."""
        return None, n_tokens * self.d_model * self.dtype.itemsize * 6

    def record(self, plan: Plan) -> dict[str, Any]:
        """Engine-specific attributes to store with a prompt computed under ``plan`` (none by default)."""
        return {}

    def parameter_count(self) -> int:
        """The model's parameters, a tied unembedding counted once."""
        return sum(p.numel() for p in self.model.parameters())

    def ordinary(self) -> Engine:
        """The same model computing ordinary (not detached) Jacobians: the contrast of the exactness report. By
        default a copy with ``detach`` off and its own stats; an engine whose state depends on ``detach`` overrides
        it."""
        other = copy.copy(self)
        other.detach, other.stats = False, EngineStats()
        return other

    @abstractmethod
    def stock_logits(self, token_ids: Sequence[int], position: int) -> torch.Tensor:
        """(vocab,) the logits of the unmodified model at ``position`` (its own norms, in their own dtypes)."""
