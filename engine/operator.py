"""The detached Jacobian of one prompt as a linear operator: products with ``J`` and ``J^T``, never ``J`` itself.

``J`` maps the stacked input embeddings to the output at the target position: it is
``[J_1 ... J_n]``, shape (d_model, n_tokens * d_model), with columns token-major as in
:meth:`detjac.engine.JacobianResult.combined`. Forming it costs ``d_model`` pullbacks and
``d_model * n_tokens * d_model`` numbers (2 GiB in float64 at d_model 512 and 1024 tokens);
many analyses need only a few products with it, for instance the top singular triplets
(:func:`detjac.engine.svds.top_singular`).

``matvec(V)`` computes ``J V`` for a block of input-space columns and ``rmatvec(U)`` computes
``J^T U`` for a block of output-space columns, both vmapped over the block's columns.
Blocks wider than ``block`` columns are split, so memory is one block of vectors, whatever
the number of columns asked for.

Two implementations:

- :class:`ModelOperator`: an in-memory model of any supported family. The forward pass runs
  once at construction, with its pullback kept (as :func:`detjac.engine.stream_jacobian`
  does): ``rmatvec`` is the vmapped pullback (``torch.func.vjp``). ``matvec`` is the pullback
  of the pullback (a linear map's transpose, see :class:`ModelOperator`) or, with
  ``forward="jvp"``, forward mode (``torch.func.jvp`` of the linearized forward). For an
  affine family (``y = J x + b``) the products are with the linear part ``J``: the offset's
  derivative is zero, and ``b`` itself is computed at construction, for the exactness check.
- :class:`StreamedOperator`: a :class:`detjac.engine.streamed.StreamedModel`. The forward
  pass (its trace) runs once; each block of products is one sweep through the layers
  (bottom-up by ``torch.func.jvp`` for ``matvec``, top-down by ``torch.func.vjp`` for
  ``rmatvec``), reading each layer's weights once per block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from detjac.errors import InvalidArgumentError, LinearizationError

from .jacobian import FLOAT64_EXACTNESS_BOUND, relative_error, stream_jacobian
from .linearize import linearized

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .streamed import StreamedModel

DEFAULT_BLOCK = 64


@dataclass
class OperatorStats:
    """What an operator has computed so far: columns through ``J`` and ``J^T``, sweeps, the widest block."""

    matvecs: int = 0
    rmatvecs: int = 0
    sweeps: int = 0
    widest_block: int = 0

    @property
    def products(self) -> int:
        """Vectors pushed through the model in either direction."""
        return self.matvecs + self.rmatvecs


class JacobianOperator(ABC):
    """``J`` (d_model, n_tokens * d_model) of one prompt, applied by blocks of at most ``block`` columns.

    Attributes
    ----------
    token_ids : list[int]
        The prompt's token ids (n_tokens).
    position : int
        The target position (non-negative).
    embeddings : torch.Tensor
        (n_tokens, d_model) the input embeddings ``x``.
    output : torch.Tensor
        (d_model,) the output ``y`` at the target position.
    bias : torch.Tensor or None
        (d_model,) the offset ``b`` of an affine family's map ``y = J x + b`` (None otherwise).
    detached : bool
        The detached Jacobian (True) or the ordinary one.
    stats : OperatorStats
        Products computed so far.
    """

    token_ids: list[int]
    position: int
    embeddings: torch.Tensor
    output: torch.Tensor
    bias: torch.Tensor | None
    detached: bool

    def __init__(self, block: int) -> None:
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise InvalidArgumentError(f"Expected block to be a positive integer. Got {block!r} instead.")
        self.block = block
        self.stats = OperatorStats()

    @property
    def n_tokens(self) -> int:
        return int(self.embeddings.shape[0])

    @property
    def d_model(self) -> int:
        return int(self.embeddings.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        """(d_model, n_tokens * d_model)."""
        return int(self.output.shape[0]), self.n_tokens * self.d_model

    @property
    def dtype(self) -> torch.dtype:
        return self.output.dtype

    @property
    def device(self) -> torch.device:
        return self.output.device

    @property
    def produced(self) -> torch.Tensor:
        """(d_model,) what ``J`` produces from the prompt, ``J x``: the output less an affine model's offset."""
        return self.output - self.bias if self.bias is not None else self.output

    def matvec(self, V: torch.Tensor) -> torch.Tensor:
        """``J V`` for V (n_tokens * d_model,) or (n_tokens * d_model, c); returns (d_model,) or (d_model, c)."""
        cols = self._columns(V, self.shape[1], "matvec")
        out = torch.empty(self.shape[0], cols.shape[1], dtype=self.dtype, device=self.device)
        for c0 in range(0, cols.shape[1], self.block):
            chunk = cols[:, c0:c0 + self.block]  # (N, c)
            tangents = chunk.T.reshape(-1, self.n_tokens, self.d_model)  # (c, n, d)
            out[:, c0:c0 + chunk.shape[1]] = self._push(tangents).T
            self._count("matvecs", chunk.shape[1])
        return out[:, 0] if V.dim() == 1 else out

    def rmatvec(self, U: torch.Tensor) -> torch.Tensor:
        """``J^T U`` for U (d_model,) or (d_model, c); returns (n_tokens * d_model,) or (n_tokens * d_model, c)."""
        cols = self._columns(U, self.shape[0], "rmatvec")
        out = torch.empty(self.shape[1], cols.shape[1], dtype=self.dtype, device=self.device)
        for c0 in range(0, cols.shape[1], self.block):
            chunk = cols[:, c0:c0 + self.block]  # (d, c)
            out[:, c0:c0 + chunk.shape[1]] = self._pull(chunk.T).reshape(chunk.shape[1], -1).T
            self._count("rmatvecs", chunk.shape[1])
        return out[:, 0] if U.dim() == 1 else out

    def gram(self, Q: torch.Tensor) -> torch.Tensor:
        """``J J^T Q`` for Q (d_model, c) -> (d_model, c), one block at a time (one block of ``J^T Q`` is held)."""
        cols = self._columns(Q, self.shape[0], "gram")
        out = torch.empty_like(cols)
        for c0 in range(0, cols.shape[1], self.block):
            out[:, c0:c0 + self.block] = self.matvec(self.rmatvec(cols[:, c0:c0 + self.block]))
        return out

    def reconstruction_error(self) -> float:
        """``||J x + b - y|| / ||y||`` from one product: whether the operator is the exact linear system."""
        jx = self.matvec(self.embeddings.reshape(-1))
        return relative_error(jx + self.bias if self.bias is not None else jx, self.output)

    def check(self) -> float:
        """The reconstruction error; raises :class:`LinearizationError` for a detached float64 operator above
        ``FLOAT64_EXACTNESS_BOUND`` (a nonlinearity escaped the detach rules)."""
        err = self.reconstruction_error()
        if self.detached and self.dtype == torch.float64 and not err < FLOAT64_EXACTNESS_BOUND:
            raise LinearizationError(
                f"Expected the detached float64 operator to reconstruct the output exactly (relative error < "
                f"{FLOAT64_EXACTNESS_BOUND:g}). Got {err:.3e}: a nonlinearity escaped the detach rules. "
                "Please report this model."
            )
        return err

    @abstractmethod
    def _push(self, tangents: torch.Tensor) -> torch.Tensor:
        """(c, n_tokens, d_model) input directions -> (c, d_model) their images ``J v``."""

    @abstractmethod
    def _pull(self, cotangents: torch.Tensor) -> torch.Tensor:
        """(c, d_model) output directions -> (c, n_tokens, d_model) their pullbacks ``J^T u``."""

    def _count(self, which: str, columns: int) -> None:
        setattr(self.stats, which, getattr(self.stats, which) + columns)
        self.stats.sweeps += 1
        self.stats.widest_block = max(self.stats.widest_block, columns)

    def _columns(self, X: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        if not isinstance(X, torch.Tensor) or X.dim() not in (1, 2) or X.shape[0] != rows:
            got = tuple(X.shape) if isinstance(X, torch.Tensor) else type(X).__name__
            raise InvalidArgumentError(f"Expected {what} of a tensor ({rows},) or ({rows}, columns). Got {got}.")
        return (X[:, None] if X.dim() == 1 else X).to(dtype=self.dtype, device=self.device)


class ModelOperator(JacobianOperator):
    """``J`` of an in-memory model (every supported family); see the module docstring.

    Parameters
    ----------
    model
        A loaded model of a supported family.
    prompt
        Text or token ids.
    position
        Target position (default: the last; 0, [CLS], for encoders).
    block
        Columns per vmapped product: memory grows with it, results do not change.
    detach
        The detached Jacobian (default) or the ordinary one.
    forward
        How ``matvec`` computes ``J V``. ``"transpose"`` (default): the pullback ``u -> J^T u``
        is linear, so its own pullback is ``v -> J v``; it runs the backward graph of the
        kept pullback backwards, through exactly the linear path. ``"jvp"``: forward mode
        (``torch.func.jvp`` of the linearized forward, vmapped over the columns), which runs
        the whole forward again with the tangents (query, key and gate projections run on
        detached inputs, so no tangent goes through them): measured 1.2-1.3x the time of
        ``"transpose"`` for 32 columns on a float64 d_model 512, 4-layer Llama at 64 and 256
        tokens, with identical products.
    """

    FORWARD_MODES = ("transpose", "jvp")

    def __init__(self, model: PreTrainedModel, prompt: str | Sequence[int] | torch.Tensor, *,
                 position: int | None = None, block: int = DEFAULT_BLOCK, detach: bool = True,
                 tokenizer: Any | None = None, forward: str = "transpose") -> None:
        super().__init__(block)
        if forward not in self.FORWARD_MODES:
            raise InvalidArgumentError(f"Expected forward one of {', '.join(self.FORWARD_MODES)}. Got {forward!r}.")
        self.model, self.forward = model, forward
        self._stream = stream_jacobian(model, prompt, row_block=block, detach=detach, position=position,
                                       tokenizer=tokenizer)
        s = self._stream
        self.token_ids, self.position, self.detached = s.token_ids, s.position % len(s.token_ids), detach
        self.embeddings, self.output, self.bias = s.embeddings, s.output, s.bias
        self._transpose: Any = None
        if forward == "transpose":  # any point will do: the pullback is linear in its cotangent
            with torch.enable_grad():
                _, self._transpose = torch.func.vjp(lambda u: s._pullback(u)[0], torch.zeros_like(s.output))

    def _push(self, tangents: torch.Tensor) -> torch.Tensor:
        if self._transpose is not None:
            with torch.no_grad():
                return torch.func.vmap(self._transpose)(tangents)[0]
        x, p = self.embeddings, self.position
        with linearized(self.model, detach=self.detached) as lin, torch.no_grad():
            def target(e: torch.Tensor) -> torch.Tensor:  # (n, d) -> (d,)
                return lin.decoder(inputs_embeds=e[None], use_cache=False).last_hidden_state[0, p]

            return torch.func.vmap(lambda v: torch.func.jvp(target, (x,), (v,))[1])(tangents)

    def _pull(self, cotangents: torch.Tensor) -> torch.Tensor:
        return self._stream.pull(cotangents)


class StreamedOperator(JacobianOperator):
    """``J`` of a layer-streamed model: each block of products is one sweep through its layers.

    Parameters
    ----------
    model
        A :class:`~detjac.engine.streamed.StreamedModel`.
    prompt
        Text or token ids.
    position
        Target position (default: the last).
    block
        Columns per sweep. Default: the row block the model's memory budget allows
        (:meth:`StreamedModel.plan`), or 64 without a budget.
    """

    def __init__(self, model: StreamedModel, prompt: str | Sequence[int] | torch.Tensor, *,
                 position: int | None = None, block: int | None = None, progress: bool = False) -> None:
        from .streamed import Target

        self.model = model
        self._target = Target(-1, "output")
        self.trace = model.trace(prompt, position=-1 if position is None else position, progress=progress)
        if block is None:
            block = model.plan(self.trace, [self._target], mode="reverse").row_block
        super().__init__(block)
        t = self.trace
        self.token_ids, self.position, self.detached = t.token_ids, t.position, model.detach
        self.embeddings, self.output, self.bias = t.embeddings, t.output, None

    def _push(self, tangents: torch.Tensor) -> torch.Tensor:
        (block,) = self.model._forward(self.trace, [self._target], 0, tangents.shape[0], False, tangent=tangents)
        return block.values.T  # (c, d)

    def _pull(self, cotangents: torch.Tensor) -> torch.Tensor:
        seed = torch.zeros(cotangents.shape[0], self.n_tokens, self.d_model, dtype=self.dtype, device=self.device)
        seed[:, self.position] = cotangents
        (block,) = self.model._reverse(self.trace, [self._target], 0, cotangents.shape[0], False, seed=seed)
        return block.values  # (c, n, d)


def jacobian_operator(model: PreTrainedModel | StreamedModel, prompt: str | Sequence[int] | torch.Tensor, *,
                      position: int | None = None, block: int | None = None, detach: bool = True,
                      tokenizer: Any | None = None, forward: str = "transpose",
                      progress: bool = False) -> JacobianOperator:
    """The operator ``J`` of ``prompt``: :class:`StreamedOperator` for a ``StreamedModel``, else :class:`ModelOperator`.

    A ``StreamedModel`` carries its own ``detach`` setting and tokenizer and always pushes
    tangents in forward mode; ``detach``, ``tokenizer`` and ``forward`` apply to an in-memory model.
    """
    from .streamed import StreamedModel

    if isinstance(model, StreamedModel):
        return StreamedOperator(model, prompt, position=position, block=block, progress=progress)
    return ModelOperator(model, prompt, position=position, block=DEFAULT_BLOCK if block is None else block,
                         detach=detach, tokenizer=tokenizer, forward=forward)
