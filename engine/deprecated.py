"""Public names kept for one release, each a thin alias that warns (``DeprecationWarning``) and calls what replaced
it: :func:`detached_jacobian` (now :func:`detjac.engine.jacobian` of an
:class:`~detjac.engine.inmemory.inmemory_engine.InMemoryEngine`) and :func:`stream_jacobian` (the in-memory engine's
own trace; the blocks come from :meth:`~detjac.engine.Engine.blocks` or :func:`detjac.engine.prompt_pass`)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from detjac.errors import InvalidArgumentError

from .inmemory.inmemory_engine import InMemoryEngine
from .inmemory.rows import JacobianStream, trace_model
from .products.logits import logit_jacobian
from .result import JacobianResult
from .verbs import jacobian

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated: use {new}.", DeprecationWarning, stacklevel=3)


def stream_jacobian(model: PreTrainedModel, prompt: str | Sequence[int] | torch.Tensor, **options: Any
                    ) -> JacobianStream:
    """Deprecated: the forward pass and its Jacobian's row blocks (:func:`detjac.engine.inmemory.rows.trace_model`,
    which takes the same options); use :meth:`InMemoryEngine.trace` and :meth:`~detjac.engine.Engine.blocks`, or
    :func:`detjac.engine.prompt_pass`."""
    _warn("stream_jacobian(model, prompt)", "detjac.engine.prompt_pass(InMemoryEngine(model), prompt, sink=...)")
    return trace_model(model, prompt, **options)


def detached_jacobian(
    model: PreTrainedModel,
    prompt: str | Sequence[int] | torch.Tensor,
    *,
    row_block: int | None = None,
    detach: bool = True,
    position: int | None = None,
    target: str = "hidden",
    logit_tokens: Sequence[int] | None = None,
    tokenizer: Any | None = None,
    check: bool = True,
    progress: bool = False,
) -> JacobianResult:
    """Deprecated: :func:`detjac.engine.jacobian` of ``InMemoryEngine(model)``. The detached (or ordinary) Jacobian of
    the final hidden state w.r.t. the input embeddings of a loaded model.

    Parameters
    ----------
    model
        A loaded causal LM of a supported family (see :func:`load_model`).
    prompt
        Text or token ids.
    row_block
        Rows per vmapped pullback; the result does not depend on it. Default: the engine's plan (its cost model).
    detach
        ``True`` for the detached Jacobian ``J+`` (exact linear system), ``False`` for
        the ordinary Jacobian of the same computation.
    position
        Token position whose output is the target (default: the last; 0, [CLS], for encoders).
    target
        ``"hidden"`` (default) or ``"logits"``, which also fills ``logit_jacobian`` as
        ``W_U[logit_tokens] @ J`` (all tokens if ``logit_tokens`` is None).
    check
        For a detached float64 Jacobian, raise :class:`LinearizationError` if the
        reconstruction error exceeds ``FLOAT64_EXACTNESS_BOUND``: a nonlinearity that no
        rule froze makes the linear system wrong, and that must not pass silently.
    progress
        Show a progress bar over row blocks.

    Returns
    -------
    JacobianResult
        ``jacobian`` is (d_model, n_tokens, d_model).
    """
    _warn("detached_jacobian(model, prompt)", "detjac.engine.jacobian(InMemoryEngine(model), prompt)")
    if target not in ("hidden", "logits"):
        raise InvalidArgumentError(f"Expected target 'hidden' or 'logits'. Got {target!r} instead.")
    engine = InMemoryEngine(model, detach=detach, tokenizer=tokenizer)
    result = jacobian(engine, prompt, position=position, row_block=row_block, check=check, progress=progress)
    if target == "logits":
        result.logit_tokens = list(logit_tokens) if logit_tokens is not None else None
        result.logit_jacobian = logit_jacobian(model, result, logit_tokens)
    return result
