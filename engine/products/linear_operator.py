"""The detached Jacobian of one prompt as a linear operator: products with ``J`` and ``J^T``, never ``J`` itself.

:class:`JacobianOperator` works on any :class:`~detjac.engine.interface.Engine` and a trace of the prompt (``matvec``:
``J V``, ``rmatvec``: ``J^T U``, in blocks); :func:`jacobian_operator` builds one from a loaded model or an engine.
Details: docs/engine.md, "The matrix-free operator"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from detjac.errors import InvalidArgumentError
from detjac.exactness import check_exact, relative_error
from detjac.targets import OUTPUTS

from ..cost import check_positive
from ..interface import Engine
from ..selection import as_engine
from ..types import Prompt, Trace


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


def check_block(block: Any) -> int:
    """``block`` (columns per product sweep) as a positive int, or an :class:`InvalidArgumentError`."""
    return check_positive("block", block)


class JacobianOperator:
    """``J`` (d_model, n_tokens * d_model) of one prompt, applied by blocks of at most ``block`` columns.

    Parameters
    ----------
    engine
        Any engine (:class:`~detjac.engine.interface.Engine`).
    trace
        The prompt's forward pass, from ``engine.trace``.
    block
        Columns per product sweep: memory grows with it, results do not change. Default: the row block
        the engine plans for the output (its cost model's, from the budget or the memory this machine has free).

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

    def __init__(self, engine: Engine, trace: Trace, block: int | None = None) -> None:
        if block is None:
            block = engine.plan(trace, [OUTPUTS], mode="reverse").row_block
        self.engine, self.trace, self.block = engine, trace, check_block(block)
        self.stats = OperatorStats()
        self.token_ids, self.position, self.detached = trace.token_ids, trace.position, engine.detach
        self.embeddings, self.output, self.bias = trace.embeddings, trace.output, trace.bias

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
        check_exact(err, self.dtype, detached=self.detached)
        return err

    def _push(self, tangents: torch.Tensor) -> torch.Tensor:
        """(c, n_tokens, d_model) input directions -> (c, d_model) their images ``J v``."""
        return self.engine.push(self.trace, tangents)

    def _pull(self, cotangents: torch.Tensor) -> torch.Tensor:
        """(c, d_model) output directions -> (c, n_tokens, d_model) their pullbacks ``J^T u``."""
        return self.engine.pull(self.trace, cotangents)

    def _count(self, which: str, columns: int) -> None:
        setattr(self.stats, which, getattr(self.stats, which) + columns)
        self.stats.sweeps += 1
        self.stats.widest_block = max(self.stats.widest_block, columns)

    def _columns(self, X: torch.Tensor, rows: int, what: str) -> torch.Tensor:
        if not isinstance(X, torch.Tensor) or X.dim() not in (1, 2) or X.shape[0] != rows:
            got = tuple(X.shape) if isinstance(X, torch.Tensor) else type(X).__name__
            raise InvalidArgumentError(f"Expected {what} of a tensor ({rows},) or ({rows}, columns). Got {got}.")
        return (X[:, None] if X.dim() == 1 else X).to(dtype=self.dtype, device=self.device)


def jacobian_operator(model: Any, prompt: Prompt, *, position: int | None = None, block: int | None = None,
                      detach: bool = True, tokenizer: Any | None = None, forward: str = "transpose",
                      progress: bool = False) -> JacobianOperator:
    """The operator ``J`` of ``prompt`` on ``model``: an engine, or a loaded transformers model.

    An engine carries its own ``detach`` setting, tokenizer and way of pushing tangents;
    ``detach``, ``tokenizer`` and ``forward`` (see :class:`~detjac.engine.inmemory.inmemory_engine.InMemoryEngine`)
    apply to a loaded model. ``block`` defaults to the engine's planned row block.
    """
    if block is not None:
        check_block(block)  # before the forward pass
    engine = as_engine(model, detach=detach, tokenizer=tokenizer, forward=forward)
    return JacobianOperator(engine, engine.trace(prompt, position=position, progress=progress), block)


def ModelOperator(model: Any, prompt: Prompt, *, position: int | None = None, block: int | None = None,  # noqa: N802
                  detach: bool = True, tokenizer: Any | None = None, forward: str = "transpose") -> JacobianOperator:
    """``J`` of a loaded model (every supported family): :func:`jacobian_operator` with the in-memory engine."""
    return jacobian_operator(model, prompt, position=position, block=block, detach=detach, tokenizer=tokenizer,
                             forward=forward)


def StreamedOperator(model: Any, prompt: Prompt, *, position: int | None = None,  # noqa: N802
                     block: int | None = None, progress: bool = False) -> JacobianOperator:
    """``J`` of a :class:`~detjac.engine.streamed.streamed_engine.StreamedEngine`: :func:`jacobian_operator` on that
    engine."""
    return jacobian_operator(model, prompt, position=position, block=block, progress=progress)
