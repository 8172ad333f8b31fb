"""Exactness figures for one model and prompt: the numbers the demo and CLI print."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from .jacobian import JacobianResult, detached_jacobian


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
    device = det.output.device
    with torch.no_grad():
        stock = model(torch.tensor([det.token_ids], device=device), use_cache=False).logits[0, det.position]
    diff = float((stock.to(det.logits.dtype) - det.logits).abs().max())
    return ExactnessReport(det, ordi, diff, int(stock.argmax()) == det.reconstructed_next_token_id, seconds)
