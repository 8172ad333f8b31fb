"""The verbs of one prompt, each one :func:`~detjac.engine.prompt_products.prompt_pass`: :func:`jacobian`, the one
Jacobian entry point (a prompt's whole output Jacobian from any :class:`~detjac.engine.interface.Engine`, with what it
reconstructs, as a :class:`~detjac.engine.result.JacobianResult`); the attribution graph's verb is the layer
above's (:func:`detjac.graphs.attribution_graph`)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from detjac.exactness import check_exact
from detjac.targets import OUTPUTS
from detjac.tokens import token_texts

from .interface import Engine
from .prompt_products import Assembled, PromptProducts, prompt_pass
from .result import JacobianResult
from .types import Prompt


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
    products = prompt_pass(engine, prompt, [OUTPUTS], position=position, row_block=row_block, progress=progress)
    return _result(engine, prompt, position, check, products, products.jacobians[OUTPUTS])


class ResultSink(Assembled):
    """A block sink that assembles the output's Jacobian and, once its prompt pass finishes, holds the
    :class:`~detjac.engine.result.JacobianResult` that :func:`jacobian` would return (``result``; None until then).
    Beside a store's sink (:class:`~detjac.engine.prompt_products.Tee`), the Jacobian a run stores is the one a
    caller prints, computed once (``detjac jacobian --out run.zarr``)."""

    def __init__(self, engine: Engine, prompt: Prompt, *, position: int | None = None, check: bool = True) -> None:
        self.engine, self.prompt, self.position, self.check = engine, prompt, position, check
        self.result: JacobianResult | None = None
        self.jacobians: dict = {}

    def open(self, products: PromptProducts) -> AbstractContextManager[Any]:
        super().__init__(self.engine, products.trace, [OUTPUTS])  # sized by the trace, known only now
        return nullcontext()

    def finish(self, products: PromptProducts) -> None:
        self.result = _result(self.engine, self.prompt, self.position, self.check, products,
                              self.jacobians[OUTPUTS])


def _result(engine: Engine, prompt: Prompt, position: int | None, check: bool, products: PromptProducts,
            jac: torch.Tensor) -> JacobianResult:
    """The output's Jacobian ``jac`` of one prompt pass with what it reconstructs, checked (see :func:`jacobian`)."""
    trace = products.trace
    recon, err = products.reconstructions[OUTPUTS], products.errors[OUTPUTS]
    if check:
        check_exact(err, jac.dtype, detached=engine.detach, family=engine.family.name)
    logits, recon_logits = engine.logits(torch.stack([trace.output, recon]))
    tok = engine.tokenizer
    assert products.plan is not None  # planned: a target was asked for
    return JacobianResult(
        jacobian=jac, embeddings=trace.embeddings, output=trace.output, reconstruction=recon,
        reconstruction_error=err, token_ids=list(trace.token_ids), tokens=token_texts(tok, trace.token_ids),
        tokenizer=tok, prompt=prompt if isinstance(prompt, str) else None,  # the position as asked (-1: the last)
        position=engine.family.default_position if position is None else position, detached=engine.detach,
        family=engine.family.name, model_type=engine.config.model_type, dtype=jac.dtype,
        row_block=products.plan.row_block, detach_rules=engine.family.describe(engine.convention) if engine.detach
        else [], logits=logits, reconstruction_logits=recon_logits, bias=trace.bias,
    )

