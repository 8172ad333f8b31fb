"""The verbs of one prompt, each one :func:`~detjac.engine.prompt_products.prompt_pass`: :func:`jacobian`, the one
Jacobian entry point (a prompt's whole output Jacobian from any :class:`~detjac.engine.interface.Engine`, with what it
reconstructs, as a :class:`~detjac.engine.result.JacobianResult`), and :func:`attribution_graph`."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from detjac.exactness import check_exact
from detjac.graph_settings import GraphSettings
from detjac.targets import OUTPUTS
from detjac.tokens import token_texts

from .interface import Engine
from .prompt_products import prompt_pass
from .result import JacobianResult
from .tools.attribution import AttributionGraph
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
    trace, jac = products.trace, products.jacobians[OUTPUTS]
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


def attribution_graph(engine: Engine, prompt: Prompt, settings: GraphSettings | None = None, *,
                      progress: bool = False) -> AttributionGraph:
    """The exact attribution graph of the prediction at the prompt's last position
    (:mod:`detjac.engine.tools.attribution`).

    Parameters
    ----------
    engine
        Any engine with neuron sites (:attr:`~detjac.engine.Engine.pullback_sites`): explicit detached sweeps.
    prompt
        Text or token ids.
    settings
        What the graph is computed with (:class:`~detjac.graph_settings.GraphSettings`: neurons ranked into the
        adjacency, logit targets, rows per pass, links split by attention head and the pruning they are chosen in);
        None: circuit-tracer's defaults.
    progress
        Show a progress bar.

    Raises
    ------
    UnsupportedModelError
        A family whose neurons have no definition here (post-norm layers; an MLP not known as one).
    InvalidArgumentError
        Settings out of range (before any work), an engine without neuron sites (autograd sweeps, ordinary
        Jacobian), a ``max_nodes`` the memory budget cannot hold, or more ``heads`` than the pruned graph's links
        (before any is loaded).
    PromptError
        An empty prompt, unknown ids, or more tokens than the model's context.
    """
    graph = prompt_pass(engine, prompt, [], graph=settings or GraphSettings(), progress=progress).graph
    assert graph is not None  # asked for
    return graph


class DeprecatedVerbs:
    """``engine.jacobian(prompt)``, the method form of :func:`jacobian` kept for one release."""

    def jacobian(self, prompt: Prompt, **options: Any) -> JacobianResult:
        """Deprecated: :func:`detjac.engine.jacobian` (``jacobian(engine, prompt)``)."""
        warnings.warn("Engine.jacobian(prompt) is deprecated: use detjac.engine.jacobian(engine, prompt).",
                      DeprecationWarning, stacklevel=2)
        return jacobian(self, prompt, **options)  # type: ignore[arg-type]
