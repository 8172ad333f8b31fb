"""Exactness figures for one model and prompt: the numbers the demo and CLI print."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from detjac.progress import labelled

from ..interface import Engine
from ..result import JacobianResult
from ..selection import as_engine
from ..types import Prompt
from ..verbs import jacobian


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


def exactness_report(model: Engine | PreTrainedModel, prompt: Prompt, *, row_block: int | None = None,
                     ordinary: bool = True, tokenizer: Any | None = None, progress: bool = False,
                     detached: tuple[JacobianResult, float] | None = None) -> ExactnessReport:
    """Compute the detached (and, with ``ordinary``, the ordinary) Jacobian of ``prompt`` with an engine (or a loaded
    model, in the in-memory engine) and compare with the unmodified model; with ``progress``, one bar per pass,
    labelled ``detached Jacobian`` and ``ordinary Jacobian``. ``detached``: the detached Jacobian of ``prompt``
    computed already, and its seconds (a run that stored it, :class:`~detjac.engine.verbs.ResultSink`); None:
    computed here."""
    engine = as_engine(model, tokenizer=tokenizer)
    if detached is None:
        t0 = time.perf_counter()
        with labelled("detached Jacobian"):  # one labelled bar per pass: the two passes' bars are told apart
            det = jacobian(engine, prompt, row_block=row_block, progress=progress)
        seconds = time.perf_counter() - t0
    else:
        det, seconds = detached
    ordi = None
    if ordinary:
        with labelled("ordinary Jacobian"):
            ordi = jacobian(engine.ordinary(), prompt, row_block=row_block, progress=progress)
    stock = engine.stock_logits(det.token_ids, det.position)
    diff = float((stock.to(det.logits.dtype) - det.logits).abs().max())
    return ExactnessReport(det, ordi, diff, int(stock.argmax()) == det.reconstructed_next_token_id, seconds)
