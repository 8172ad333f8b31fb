"""The engine interface: what every engine provides, so that no caller asks which one it holds.

:class:`Engine`, implemented by the in-memory and the layer-streamed engine: trace a prompt, plan a request, yield
blocks of Jacobians, apply ``J`` and ``J^T`` to blocks of vectors, decode and score. Details: docs/engine.md, "Two
engines, one interface"."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from detjac.errors import InvalidArgumentError
from detjac.exactness import check_exact, relative_error
from detjac.targets import OUTPUTS, Target, layer_index
from detjac.tokens import token_texts

from .pullback import CUTS, EVERY_POSITION, READ_KINDS, SEED_KINDS, PullRequest, Seed, Site, input_of, neurons_of
from .result import JacobianResult, reconstruct

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


class Engine(ABC):
    """A loaded model that linearizes prompts. See the module docstring.

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
    stats : EngineStats
        Layers read and run so far.
    """

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

    def __repr__(self) -> str:  # the model (as load_engine took it, else its config's path), family, dtype, ...
        ref, kind = getattr(self, "model_ref", None), "layer-streamed" if getattr(self, "streamed", 0) else "in memory"
        name = ref.name if ref is not None else getattr(self.config, "name_or_path", "") or "a loaded model"
        return (f"<{type(self).__name__} of {name!r}: {self.family.name}, {str(self.dtype).removeprefix('torch.')}, "
                f"{self.device}, {kind}, {'detached' if self.detach else 'ordinary'}, {self.n_layers} layers, "
                f"d_model {self.d_model}>")

    @property
    @abstractmethod
    def tokenizer(self) -> Any | None:
        """The model's tokenizer, or None when the checkpoint has none (prompts must then be token ids)."""

    @property
    def context(self) -> int:
        """The model's context length in tokens (unbounded when its config does not say)."""
        return getattr(self.config.get_text_config(), "max_position_embeddings", None) or 2**31

    @abstractmethod
    def prompt_model(self) -> Any:
        """What :func:`detjac.engine.parse_prompt` checks token ids against (vocabulary size, config)."""

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
    def plan(self, trace: Trace, targets: Sequence[Target], *, mode: str = "auto", row_block: int | None = None,
             token_block: int | None = None) -> Plan:
        """Split ``targets`` between reverse and forward mode and size the blocks.

        Raises
        ------
        InvalidArgumentError
            A target this engine cannot compute, an unknown mode, a non-positive block, or a memory budget
            too small for one block.
        """

    @abstractmethod
    def blocks(self, trace: Trace, targets: Sequence[Target], plan: Plan | None = None, *,
               progress: bool = False) -> Iterator[JacobianBlock]:
        """Every requested Jacobian, block by block (reverse mode first, then forward mode)."""

    @abstractmethod
    def push(self, trace: Trace, tangents: torch.Tensor) -> torch.Tensor:
        """``J v`` of the output's Jacobian: (c, n_tokens, d_model) input directions -> (c, d_model)."""

    @abstractmethod
    def pull(self, trace: Trace, cotangents: torch.Tensor) -> torch.Tensor:
        """``J^T u`` of the output's Jacobian: (c, d_model) output directions -> (c, n_tokens, d_model)."""

    # -- the pullback primitive (detjac.engine.pullback) ---------------------------------------

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

    def check_neurons(self) -> None:
        """Refuse, by name, an engine without neuron sites (see :meth:`check_pull`)."""
        self.check_pull([PullRequest((Seed(neurons_of(0), torch.zeros(1, 1, 1)),), (neurons_of(0),), d_model=1)])

    def check_pull(self, requests: Sequence[PullRequest]) -> None:
        """Refuse, by name, a request this engine cannot honour (:attr:`pullback_sites`), before any work.

        Raises
        ------
        InvalidArgumentError
            The sites or cut it lacks, and why.
        """
        have = self.pullback_sites
        wanted = {s.site.kind for r in requests for s in r.seeds} | {x.kind for r in requests for x in r.reads} | {
            f"cut:{c}" for r in requests for c in r.cut}
        missing = sorted(wanted - have)
        if missing:
            why = "the Jacobian is not detached" if not self.detach else "the autograd sweeps were chosen"
            raise InvalidArgumentError(f"Expected pull requests this engine honours ({', '.join(sorted(have))}). Got "
                                       f"{', '.join(missing)}, which it cannot: {why}.")

    @abstractmethod
    def pulls(self, trace: Trace, requests: Sequence[PullRequest]) -> Iterator[tuple[int, Site, torch.Tensor]]:
        """Every read of every request as the sweep reaches it: ``(request index, site, cotangents)``
        (:func:`detjac.engine.pullback.pulls`).

        Raises
        ------
        InvalidArgumentError
            A request this engine cannot honour (:meth:`check_pull`), or a malformed one.
        """

    @abstractmethod
    def neurons(self, trace: Trace, layers: Sequence[int] | None = None) -> Iterator[tuple[int, torch.Tensor, Any]]:
        """``(layer, (n, n_neurons) its MLP neurons' values on the prompt, its MLP piece)`` for ``layers`` (default:
        all), one layer at a time (:func:`detjac.engine.pullback.neuron_activations`).

        Raises
        ------
        InvalidArgumentError
            An engine without neuron sites (:attr:`pullback_sites`).
        """

    @abstractmethod
    def residual_ends(self, trace: Trace) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, d) each: the residual stream on the prompt entering the first layer and leaving the last, where an
        affine family's constants outside the layers (position embeddings, the final norm's shift) are read.

        Raises
        ------
        InvalidArgumentError
            An engine without neuron sites (:attr:`pullback_sites`).
        """

    def sweep(self, trace: Trace, requests: Sequence[PullRequest]) -> list[dict[Site, torch.Tensor]]:
        """Every request's reads at once: ``[{site: cotangents}]`` (small requests; see :meth:`pulls`)."""
        out: list[dict[Site, torch.Tensor]] = [{} for _ in requests]
        for j, site, values in self.pulls(trace, requests):
            out[j][site] = values
        return out

    def pull_every_position(self, trace: Trace, cotangents: torch.Tensor, layers: Sequence[int],
                            reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """``u`` (c, d) set at the final normed state of every position at once, pulled back to the output of each
        layer in ``layers``: ``{L: (c, n, d)}`` with ``[:, k] = sum_{p' >= k} u @ dy_p' / dh_{L,k}`` (causal: the
        later positions only). The per-text quantity of the Jacobian lens of Gurnee et al. (``jlens``), exact for
        the detached model (and for the ordinary one with ``detach=False``). ``reduce`` is applied to each layer's
        block as the sweep reaches it (e.g. a mean over positions), so that only its result is kept."""
        n, d = trace.n_tokens, self.d_model
        wanted = {input_of(layer_index(layer, self.n_layers) + 1): layer for layer in layers}
        seed = cotangents.to(device=self.device, dtype=self.dtype)[:, None, :].expand(-1, n, d).contiguous()
        out: dict[int, torch.Tensor] = {}
        for _, site, values in self.pulls(trace, [PullRequest((Seed(EVERY_POSITION, seed),), tuple(wanted))]):
            out[wanted[site]] = reduce(values) if reduce is not None else values
        return {layer: out[layer] for layer in layers}

    def pull_final_block(self, trace: Trace, cotangents: torch.Tensor, layers: Sequence[int], positions: Sequence[int],
                         reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """``u`` (c, d) set at the last layer's output (the final norm's input, before the norm) at each of
        ``positions`` at once, pulled back to the output of each layer in ``layers``: ``{L: (c, n, d)}`` with
        ``[:, k] = sum_{p' in positions, p' >= k} u @ dh_{final,p'} / dh_{L,k}``. The per-text quantity of the
        reference Jacobian lens (TransformerLens' ``JacobianLens.fit``: the target is the final block's output, the
        cotangent is set at the valid positions only); ``reduce`` as in :meth:`pull_every_position`."""
        n, d = trace.n_tokens, self.d_model
        picked = sorted({int(p) for p in positions})
        if not picked or picked[0] < 0 or picked[-1] >= n:
            raise InvalidArgumentError(f"Expected target positions in [0, {n - 1}]. Got {list(positions)}.")
        wanted = {input_of(layer_index(layer, self.n_layers) + 1): layer for layer in layers}
        u = cotangents.to(device=self.device, dtype=self.dtype)
        seed = u.new_zeros(u.shape[0], n, d)  # (c, n, d): u at the picked positions, 0 elsewhere
        seed[:, picked] = u[:, None, :]
        out: dict[int, torch.Tensor] = {}
        request = PullRequest((Seed(input_of(self.n_layers), seed),), tuple(wanted))
        for _, site, values in self.pulls(trace, [request]):
            out[wanted[site]] = reduce(values) if reduce is not None else values
        return {layer: out[layer] for layer in layers}

    @abstractmethod
    def decoding_matrices(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``embedding`` (vocab, d_model), ``unembedding`` (vocab, d_model) and, where the final norm has one,
        ``final_norm`` (d_model,) its gain; on the CPU, in ``dtype`` (default: the compute dtype)."""

    def decoding_rows(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The matrices of :meth:`decoding_matrices` for copying out in row blocks: numpy arrays, or
        :class:`~detjac.engine.products.decode.RowBlocks` read on demand where an engine has a memory budget to keep."""
        return {k: v.numpy() for k, v in self.decoding_matrices(dtype).items()}

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

    @abstractmethod
    def ordinary(self) -> Engine:
        """The same model computing ordinary (not detached) Jacobians: the contrast of the exactness report."""

    @abstractmethod
    def stock_logits(self, token_ids: Sequence[int], position: int) -> torch.Tensor:
        """(vocab,) the logits of the unmodified model at ``position`` (its own norms, in their own dtypes)."""

    def jacobian(self, prompt: Prompt, *, position: int | None = None, row_block: int | None = None,
                 check: bool = True, progress: bool = False) -> JacobianResult:
        """The output's whole Jacobian with what it reconstructs (:func:`detjac.engine.jacobian`)."""
        trace = self.trace(prompt, position=position, progress=progress)
        plan = self.plan(trace, [OUTPUTS], row_block=row_block)
        jac = self.assemble(trace, [OUTPUTS], plan, progress=progress)[OUTPUTS]
        recon = reconstruct(jac, trace.embeddings, trace.bias)
        err = relative_error(recon, trace.output)
        if check:
            check_exact(err, jac.dtype, detached=self.detach, family=self.family.name)
        logits, recon_logits = self.logits(torch.stack([trace.output, recon]))
        tok = self.tokenizer
        return JacobianResult(
            jacobian=jac, embeddings=trace.embeddings, output=trace.output, reconstruction=recon,
            reconstruction_error=err, token_ids=list(trace.token_ids),
            tokens=token_texts(tok, trace.token_ids), tokenizer=tok,
            prompt=prompt if isinstance(prompt, str) else None,  # the position as asked (-1: the last token)
            position=self.family.default_position if position is None else position, detached=self.detach,
            family=self.family.name, model_type=self.config.model_type, dtype=jac.dtype, row_block=plan.row_block,
            detach_rules=self.family.describe(self.convention) if self.detach else [], logits=logits,
            reconstruction_logits=recon_logits, bias=trace.bias,
        )

    def assemble(self, trace: Trace, targets: Sequence[Target], plan: Plan, *,
                 progress: bool = False) -> dict[Target, torch.Tensor]:
        """Every requested Jacobian whole, (d_model, n_tokens, d_model) each, from :meth:`blocks` (small inputs;
        stores take the blocks as they come)."""
        n = trace.n_tokens
        out = {t: torch.empty(self.d_model, n, self.d_model, dtype=self.dtype, device=self.device) for t in targets}
        for b in self.blocks(trace, targets, plan, progress=progress):
            out[b.target][b.start:b.stop, b.token_start:b.token_stop] = b.values
        return out
