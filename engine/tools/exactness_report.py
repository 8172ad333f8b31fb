"""Exactness figures for one model and prompt: the numbers the demo and CLI print."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from ..families import family_for
from ..inmemory.rows import JacobianResult, detached_jacobian
from ..products.logits import output_logits


@dataclass(frozen=True)
class ExactnessReport:
    """Detached vs ordinary Jacobian of one forward pass, checked against the stock model.

    Attributes
    ----------
    detached, ordinary
        The two Jacobian results (``ordinary`` is None when not requested).
    stock_logit_diff
        Max |logit difference| between the detached model's forward and the unmodified
        model's (which casts norms and softmax to float32, so this is ~1e-7, not 0).
    argmax_agrees
        The stock model's next token equals the one from the reconstruction.
    seconds
        Wall time of the detached Jacobian.
    """

    detached: JacobianResult
    ordinary: JacobianResult | None
    stock_logit_diff: float
    argmax_agrees: bool
    seconds: float


def exactness_report(model: PreTrainedModel, prompt: str | Sequence[int], *, row_block: int = 64,
                     ordinary: bool = True, tokenizer: Any | None = None,
                     progress: bool = False) -> ExactnessReport:
    """Compute the detached (and ordinary) Jacobian and compare with the unmodified model."""
    t0 = time.perf_counter()
    det = detached_jacobian(model, prompt, row_block=row_block, tokenizer=tokenizer, progress=progress)
    seconds = time.perf_counter() - t0
    ordi = (detached_jacobian(model, prompt, row_block=row_block, detach=False, tokenizer=tokenizer,
                              progress=progress) if ordinary else None)
    stock = stock_logits(model, det.token_ids, det.position)
    diff = float((stock.to(det.logits.dtype) - det.logits).abs().max())
    return ExactnessReport(det, ordi, diff, int(stock.argmax()) == det.reconstructed_next_token_id, seconds)


def stock_logits(model: PreTrainedModel, token_ids: Sequence[int], position: int) -> torch.Tensor:
    """(vocab,) logits of the unmodified model at ``position``; for an encoder, its final hidden state scored
    against the word embeddings (as :func:`detjac.engine.output_logits` does)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], device=device)
    with torch.no_grad():
        if family_for(model.config).encoder:
            return output_logits(model, model(ids, use_cache=False).last_hidden_state[0, position])
        return model(ids, use_cache=False).logits[0, position]
