"""The one Jacobian verb: a prompt's whole output Jacobian from any :class:`~detjac.engine.interface.Engine`, with
what it reconstructs, as a :class:`~detjac.engine.result.JacobianResult`;
:func:`detached_jacobian` is the same on a loaded model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from detjac.errors import InvalidArgumentError
from detjac.targets import DEFAULT_ROW_BLOCK

from .inmemory.inmemory_engine import InMemoryEngine
from .interface import Engine, Prompt
from .products.logits import logit_jacobian
from .result import JacobianResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def jacobian(engine: Engine, prompt: Prompt, *, position: int | None = None, row_block: int | None = None,
             check: bool = True, progress: bool = False) -> JacobianResult:
    """The detached (or, for an engine with ``detach=False``, ordinary) Jacobian of the final normed hidden state at
    ``position`` w.r.t. the input embeddings, (d_model, n_tokens, d_model), computed by ``engine`` in row blocks of
    ``row_block`` (default: the engine's choice; the result does not depend on it).

    Raises
    ------
    LinearizationError
        ``check`` and a detached float64 Jacobian that does not reconstruct the output to
        ``FLOAT64_EXACTNESS_BOUND``: a nonlinearity that no rule froze, which must not pass silently.
    PromptError, InvalidArgumentError
        As :meth:`Engine.trace` and :meth:`Engine.plan` raise them.
    """
    return engine.jacobian(prompt, position=position, row_block=row_block, check=check, progress=progress)

def detached_jacobian(
    model: PreTrainedModel,
    prompt: str | Sequence[int] | torch.Tensor,
    *,
    row_block: int = DEFAULT_ROW_BLOCK,
    detach: bool = True,
    position: int | None = None,
    target: str = "hidden",
    logit_tokens: Sequence[int] | None = None,
    tokenizer: Any | None = None,
    check: bool = True,
    progress: bool = False,
) -> JacobianResult:
    """The detached (or ordinary) Jacobian of the final hidden state w.r.t. the input embeddings of a loaded
    model: :func:`jacobian` on its :class:`~detjac.engine.inmemory.inmemory_engine.InMemoryEngine`.

    Parameters
    ----------
    model
        A loaded causal LM of a supported family (see :func:`load_model`).
    prompt
        Text or token ids.
    row_block
        Rows per vmapped pullback; the result does not depend on it.
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
    if target not in ("hidden", "logits"):
        raise InvalidArgumentError(f"Expected target 'hidden' or 'logits'. Got {target!r} instead.")
    engine = InMemoryEngine(model, detach=detach, tokenizer=tokenizer)
    result = jacobian(engine, prompt, position=position, row_block=row_block, check=check, progress=progress)
    if target == "logits":
        result.logit_tokens = list(logit_tokens) if logit_tokens is not None else None
        result.logit_jacobian = logit_jacobian(model, result, logit_tokens)
    return result
