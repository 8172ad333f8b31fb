"""The layer-streamed engine: detached Jacobians of models larger than the compute device.

:class:`StreamedEngine` keeps the model as an empty skeleton and streams one decoder layer at a time, for every target
of :mod:`detjac.targets`, within a memory budget. How: docs/engine.md, "The layer-streamed engine"; huge pages and
budgets from Python: docs/user-guide.md, "Models larger than memory"."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from detjac.errors import InvalidArgumentError
from detjac.targets import OUTPUTS

from ..checkpoints.reference import ModelRef
from ..checkpoints.sources import open_source
from ..checkpoints.stored import check_compute_dtype
from ..checkpoints.weights import check_complete, check_shapes
from ..cost import CostModel
from ..detach.model import linearized
from ..interface import Engine
from ..memory import budgets_of, check_device, compute_dtype, device_key
from ..types import Plan, Prompt, Trace
from .adjoint import make_adjoint
from .passes import StreamedWalk
from .skeleton import Skeleton
from .source import check_quantize, load_tokenizer, model_class, streamable_family
from .tracing import LayerSteps, StreamedTrace

__all__ = ["StreamedEngine"]


class StreamedEngine(Engine):
    """A causal LM whose decoder layers are materialized one at a time.

    Parameters
    ----------
    source
        A :class:`~detjac.engine.ModelRef` (a string or path is resolved into one, once) naming a checkpoint folder
        with safetensors shards (weights are read layer by layer and
        never all held), a GGUF file (each layer's tensors read and dequantized as it is
        streamed in, see :mod:`detjac.engine.checkpoints.gguf`), a Hugging Face hub id (its snapshot in the cache, see
        :mod:`detjac.engine.checkpoints.hub`), or a loaded model (its tensors are used in place; with another
        ``device`` or ``dtype`` one layer at a time is copied).
    dtype
        Compute dtype, a torch dtype or its name (``"float32"``); float64 is the exactness mode.
    device
        Where layers are computed (``cpu``, ``cuda``, ``cuda:1``).
    detach
        Freeze the nonlinear factors (detached Jacobian) or not (ordinary Jacobian).
    max_memory
        Budgets per device, e.g. ``{"cuda:0": 8 * 2**30, "cpu": 32 * 2**30}`` or the
        ``--max-memory`` text: the row block is then chosen to fit the compute device's.
    quantize
        ``nf4``, ``fp4`` or ``int8``: run the model bitsandbytes would run after
        quantizing a float checkpoint on load (each linear weight goes through bnb's
        quantize-dequantize round trip as its layer is streamed in).
    convention
        The family's detach convention (:attr:`~detjac.engine.families.Family.conventions`); None: its default.
    sweeps
        How blocks cross a layer: ``"explicit"`` (the layer's frozen pieces as plain matmuls) or
        ``"autograd"`` (``torch.func``, the reference); default: the ``DETJAC_SWEEPS`` environment
        variable, else ``"explicit"`` (see :mod:`detjac.engine.streamed.adjoint`).
    exact
        Exactness is asked: refuse a ``dtype`` that cannot hold every weight as stored (narrower than it, or
        float16 against bfloat16), before any layer is read.

    Raises
    ------
    UnsupportedModelError
        A family the streamed engine does not support (affine, mixture of experts, encoder), or a
        module without a detach rule.
    InvalidArgumentError
        Budgets without the compute device, a bad ``quantize`` or ``sweeps``, a convention the family lacks, or
        (``exact``) a ``dtype`` below the stored weights' precision.
    CheckpointError
        A weight stored in a dtype the engine does not convert (an integer tensor where a float one belongs).
    """

    layerwise = True

    def __init__(self, source: ModelRef | str | Path | nn.Module, *, dtype: torch.dtype = torch.float64,
                 device: str | torch.device = "cpu", detach: bool = True,
                 max_memory: dict[str, int] | str | None = None, quantize: str | None = None,
                 revision: str | None = None, trust_remote_code: bool = False,
                 tokenizer: Any | None = None, convention: str | None = None, sweeps: str | None = None,
                 exact: bool = False) -> None:
        self.dtype, self.device, self.detach = compute_dtype(dtype), torch.device(check_device(device)), detach
        dtype = self.dtype
        self.budgets = budgets_of(max_memory)
        for budgeted in self.budgets:  # a budget for a device this machine lacks: said before anything loads
            check_device(budgeted)
        if self.budgets and device_key(self.device) not in self.budgets:
            raise InvalidArgumentError(
                f"Expected a memory budget for the compute device {device_key(self.device)}. "
                f"Got budgets for {', '.join(self.budgets)} only."
            )
        ref = source if isinstance(source, nn.Module) else ModelRef.of(source, revision)  # a string: resolved once
        gguf = isinstance(ref, ModelRef) and ref.is_gguf
        self.model_ref, self.streamed = (ref if isinstance(ref, ModelRef) else None), True  # for print(engine)
        config, cls, raw, self.path = model_class(ref, revision, trust_remote_code)
        source = source if self.path is None else self.path  # a hub id: the cache's snapshot folder
        self.family = streamable_family(config)
        self.convention = self.family.check_convention(convention)
        self.config = config
        weights = open_source(source, raw, config, gguf=gguf)
        check_quantize(quantize, weights.quantized or weights.packed)
        self.quantize = quantize
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source, gguf, revision,
                                                                                trust_remote_code)
        self.skeleton = Skeleton(cls, config, self.family, weights, dtype=dtype, device=self.device,
                                 quantize=quantize)
        sk = self.skeleton
        check_compute_dtype(sk.stored_dtypes, dtype, exact)
        head = sk.matrix_name("unembedding")
        check_complete(sk.model, weights, f"a checkpoint in {self.path}", optional={head} if sk.tied else (),
                       required=(sk.decoder_path + ".", head))  # what this engine reads
        check_shapes(sk.model, weights, f"a checkpoint in {self.path}")
        self.source, self.model, self.decoder, self.layers = weights, sk.model, sk.decoder, sk.layers
        self.n_layers, self.d_model, self.ffn, self.stats = sk.n_layers, sk.d_model, sk.ffn, sk.stats
        self.steps = LayerSteps(sk, self.family, detach)
        self.adjoint = make_adjoint(sk, self.steps, sweeps)
        self._linear_depth = 0
        with self._linear():  # the guard: a module without a detach rule is refused here, not mid-run
            pass
        if self.budgets:  # a budget that cannot hold one layer and one vector of a one-token prompt: refused now
            self.cost.plan(1, [OUTPUTS])

    @contextmanager
    def _linear(self) -> Iterator[None]:
        """The skeleton linearized for the duration of the block (re-entrant: nested blocks share one)."""
        if self._linear_depth:
            self._linear_depth += 1
            try:
                yield
            finally:
                self._linear_depth -= 1
            return
        with linearized(self.model, detach=self.detach, convention=self.convention):
            self._linear_depth = 1
            try:
                yield
            finally:
                self._linear_depth = 0
                self.skeleton.feed.drain()  # no read running once the engine returns

    # -- what every engine provides -------------------------------------------------------

    @property
    def explicit_sweeps(self) -> bool:
        return self.adjoint.name == "explicit"

    def prompt_model(self) -> Any:
        return self.skeleton.prompt_model()

    @property
    def cost(self) -> CostModel:
        """The cost model at this engine's shapes and compute-device budget."""
        return CostModel.of(self.config, self.dtype.itemsize, self.skeleton.layer_bytes(), detach=self.detach,
                            budget=self.memory_budget(device_key(self.device)), device=device_key(self.device),
                            sweeps=self.adjoint.sizing(), stored_bytes=self.skeleton.stored_layer_bytes())

    def memory_budget(self, device: str) -> int | None:
        return self.budgets.get(device_key(device))

    def sweep_memory(self, n_tokens: int) -> tuple[int | None, int]:
        """From the cost model: the budget less the layers' weights (two as stored, one widened), the trace and what a
        layer's crossing holds."""
        cost = self.cost
        return cost.vector_budget(n_tokens), cost.vector_bytes(n_tokens)

    def trace(self, prompt: Prompt, *, position: int | None = None, progress: bool = False) -> StreamedTrace:
        """Run the forward pass layer by layer; keep each layer's input and mid residual."""
        from . import tracing

        ids = self.token_ids(prompt)
        cost = self.cost
        self.skeleton.per_matrix = cost.per_matrix(len(ids))  # for this prompt's trace, sweeps and products
        self.skeleton.feed.keep(cost.spare_bytes(len(ids)))
        with self._linear():
            st = tracing.trace(self.skeleton, self.steps, ids, -1 if position is None else position, progress)
        st.norm = self._norm
        return st

    def _norm(self, v: torch.Tensor) -> torch.Tensor:
        """The linearized final norm of vectors (..., d) (each scale frozen at its own vector)."""
        with self._linear(), torch.no_grad():
            return self.steps.norm(v.to(self.device))

    @contextmanager
    def walk(self, trace: Trace, plan: Plan | None = None) -> Iterator[StreamedWalk]:
        """Each layer read in as the sweep reaches it (:class:`~detjac.engine.streamed.passes.StreamedWalk`); under
        ``plan``, its layers widened as it says and the layers its budget spares kept between its blocks."""
        st: StreamedTrace = StreamedTrace.own(trace, "layer-streamed")
        if plan is not None:
            self.skeleton.per_matrix = plan.widen == "matrix"
            self.skeleton.feed.keep(self.cost.spare_bytes(st.n_tokens, plan))
        with self._linear():
            yield StreamedWalk(self.skeleton, self.steps, st, self.adjoint)

    def cost_model(self, trace: Trace | None = None) -> CostModel:
        """:attr:`cost` (the same for every prompt: its shapes and budget)."""
        return self.cost

    def decoding_matrices(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Read whole from the source (see :func:`~detjac.engine.products.decode.final_norm_gain`)."""
        return self.skeleton.decoding_matrices(dtype)

    def decoding_rows(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The embedding and unembedding read from the source one row block at a time, never whole."""
        return self.skeleton.decoding_rows(dtype)

    def logits(self, hidden: torch.Tensor, *, chunk: int = 16384) -> torch.Tensor:
        """Reading the unembedding in row chunks of ``chunk``."""
        return self.skeleton.logits(hidden, chunk=chunk)

    def parameter_count(self) -> int:
        """The skeleton's parameters, less its unembedding where the checkpoint ties it to the embedding (the
        skeleton holds both as separate ``meta`` tensors)."""
        head = self.model.get_output_embeddings() if self.skeleton.tied else None
        return super().parameter_count() - (head.weight.numel() if head is not None else 0)

    def ordinary(self) -> StreamedEngine:
        """This engine's skeleton and weights, with ordinary layer steps: nothing is loaded again."""
        other = copy.copy(self)
        other.detach, other.stats = False, self.stats
        other.steps = LayerSteps(self.skeleton, self.family, False)
        other.adjoint = make_adjoint(self.skeleton, other.steps, self.adjoint.name)
        other._linear_depth = 0
        return other

    def stock_logits(self, token_ids: Sequence[int], position: int) -> torch.Tensor:
        """The skeleton's own modules, outside the detached wrappers, one layer at a time."""
        from . import tracing

        try:
            st = tracing.trace(self.skeleton, LayerSteps(self.skeleton, self.family, False), list(token_ids),
                               position)
        finally:
            self.skeleton.feed.drain()  # no read running once the engine returns (outside _linear's)
        return self.logits(st.output)

    def record(self, plan: Plan) -> dict[str, Any]:
        """The blocks and the bytes read so far, stored with each prompt as ``stream``."""
        return {"stream": {"row_block": plan.row_block, "token_block": plan.token_block,
                           "bytes_read": self.stats.bytes_read}}

    # -- memory -------------------------------------------------------------------------

    def load_layer(self, i: int) -> None:
        """Materialize decoder layer ``i`` on the compute device (then :meth:`release_layer`; no layer is read
        ahead behind a call from outside the engine)."""
        try:
            self.skeleton.load_layer(i)
        finally:
            self.skeleton.feed.drain()

    def release_layer(self, i: int) -> None:
        """Put layer ``i``'s parameters back on the meta device (their memory is freed)."""
        self.skeleton.release_layer(i)
