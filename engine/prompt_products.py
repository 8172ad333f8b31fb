"""One prompt through an engine: every product of its forward pass from one trace.

:func:`prompt_pass` traces the prompt once, hands the trace to a graph step when asked (the attribution graph of
:mod:`detjac.graphs`, the layer above), plans the requested Jacobians, sweeps their blocks (into a :class:`BlockSink`,
a store's staged prompt, or assembled whole) and computes each target's reconstruction error on the way. ``detjac run``
(``--graph`` too), ``detjac jacobian``, ``detjac graph`` and the Python verbs :func:`detjac.engine.jacobian` and
:func:`detjac.graphs.attribution_graph` all go through it, so a prompt is traced once whatever is asked of it.
Details: docs/engine.md, "One prompt pass"."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from detjac import exactness
from detjac.targets import OUTPUTS, Target

from .interface import Engine
from .result import reconstruct
from .types import JacobianBlock, Plan, Prompt, Trace


@dataclass
class PromptProducts:
    """What one prompt pass computed.

    Attributes
    ----------
    trace : Trace
        The prompt's one forward pass.
    plan : Plan or None
        How the Jacobians were computed; None when none was asked for.
    graph : AttributionGraph or None
        What the graph step made of the trace (:mod:`detjac.graphs`), when one was given.
    reconstructions : dict[Target, torch.Tensor]
        (d_model,) each target's ``sum_k J_k x_k``, the output's with an affine model's offset ``b`` added.
    errors : dict[Target, float]
        Each target's relative reconstruction error against its value (:meth:`Trace.value`).
    jacobians : dict[Target, torch.Tensor]
        (d_model, n_tokens, d_model) each target's Jacobian, assembled when no sink took the blocks; else empty.
    """

    trace: Trace
    plan: Plan | None = None
    graph: Any = None
    reconstructions: dict[Target, torch.Tensor] = field(default_factory=dict)
    errors: dict[Target, float] = field(default_factory=dict)
    jacobians: dict[Target, torch.Tensor] = field(default_factory=dict)


class BlockSink(Protocol):
    """Where a prompt pass puts the blocks: opened once the plan is known, handed every block, asked whether to sweep
    them again, and finished (inside the opened context) once the reconstruction errors are known."""

    def open(self, products: PromptProducts) -> AbstractContextManager[Any]:
        """The context the blocks go into (a store's staged prompt); ``products`` has the trace, plan and graph."""

    def take(self, block: JacobianBlock) -> None:
        """One block, as the sweep yields it."""

    def more(self) -> bool:
        """After a sweep: whether to sweep the same blocks again (a subspace iteration); False to stop."""

    def finish(self, products: PromptProducts) -> None:
        """The errors are known: check and commit what the context holds."""


def prompt_pass(engine: Engine, prompt: Prompt, targets: Sequence[Target] = (OUTPUTS,), *,
                position: int | None = None, mode: str = "auto", row_block: int | None = None,
                token_block: int | None = None, graph: Callable[[Trace], Any] | None = None,
                sink: BlockSink | None = None, progress: bool = False) -> PromptProducts:
    """Every product of one prompt from one trace: the trace, ``targets``' Jacobian blocks and reconstruction
    errors, and the attribution graph when a graph step is given.

    Parameters
    ----------
    engine
        Any engine.
    prompt
        Text or token ids.
    targets
        The Jacobians wanted (none: only the trace, and the graph).
    position
        The target position (default: the family's).
    mode, row_block, token_block
        As :meth:`~detjac.engine.Engine.plan` takes them.
    graph
        The graph step (:func:`detjac.graphs.graph_step`): called with the trace before any block, its result kept
        as ``graph``; its settings checked by its maker before the trace. None: no graph.
    sink
        Takes the blocks (a store); None: each target's Jacobian is assembled whole in ``jacobians``.
    progress
        Show progress bars (the trace's, the graph's, and the blocks' when no sink counts them itself).

    Returns
    -------
    PromptProducts

    Raises
    ------
    PromptError, InvalidArgumentError, UnsupportedModelError
        As :meth:`~detjac.engine.Engine.trace`, :meth:`~detjac.engine.Engine.plan` and the graph step raise
        them, before any block is computed.
    """
    trace = engine.trace(prompt, position=position, progress=progress)
    products = PromptProducts(trace)
    if graph is not None:
        products.graph = graph(trace)
    wanted = list(targets)
    if not wanted:
        return products
    products.plan = engine.plan(trace, wanted, mode=mode, row_block=row_block, token_block=token_block)
    whole = Assembled(engine, trace, wanted) if sink is None else None
    into: BlockSink = whole if whole is not None else sink  # type: ignore[assignment]
    with into.open(products):
        products.reconstructions = _sweep(engine, trace, products.plan, into, progress and sink is None)
        errors = {t: exactness.relative_error(r, trace.value(t)) for t, r in products.reconstructions.items()}
        products.errors = errors
        into.finish(products)
    if whole is not None:
        products.jacobians = whole.jacobians
    return products


def assemble(engine: Engine, trace: Trace, targets: Sequence[Target], plan: Plan, *,
             progress: bool = False) -> dict[Target, torch.Tensor]:
    """Every requested Jacobian whole, (d_model, n_tokens, d_model) each, from the engine's blocks of ``trace``
    under ``plan`` (small inputs; stores take the blocks as they come)."""
    whole = Assembled(engine, trace, targets)
    for b in engine.blocks(trace, targets, plan, progress=progress):
        whole.take(b)
        del b  # let a block go before the engine computes the next (:func:`_sweep`)
    return whole.jacobians


def _sweep(engine: Engine, trace: Trace, plan: Plan, sink: BlockSink, progress: bool) -> dict[Target, torch.Tensor]:
    """The blocks into ``sink``, as often as it asks; the reconstructions accumulated on the first sweep."""
    targets = plan.reverse + plan.forward
    recon = {t: torch.zeros_like(trace.value(t)) for t in targets}
    first = True
    while True:
        for b in engine.blocks(trace, targets, plan, progress=progress):
            if first:
                x = trace.source(b.target)[b.token_start:b.token_stop]
                recon[b.target][b.start:b.stop] += reconstruct(b.values, x)
            sink.take(b)
            del b  # taken: held while the engine computes the next, it would be a block's rows the budget never counted
        first = False
        if not sink.more():
            break
    if OUTPUTS in recon and trace.bias is not None:  # an affine model: y = sum_k J_k x_k + b
        recon[OUTPUTS] = recon[OUTPUTS] + trace.bias
    return recon


class Tee:
    """A sink that hands every block to each of ``sinks`` in turn: a store's staged prompt and, beside it, what a caller
    keeps of the same pass (``detjac jacobian --out run.zarr`` prints the Jacobian it stores, computed once). Opened,
    finished and asked for more in order; a sweep is repeated while any sink asks for it."""

    def __init__(self, *sinks: BlockSink) -> None:
        self.sinks = sinks

    @contextmanager
    def open(self, products: PromptProducts) -> Iterator[None]:
        with ExitStack() as stack:
            for s in self.sinks:
                stack.enter_context(s.open(products))
            yield

    def take(self, block: JacobianBlock) -> None:
        for s in self.sinks:
            s.take(block)

    def more(self) -> bool:
        return any([s.more() for s in self.sinks])  # a list: every sink is told that a sweep ended

    def finish(self, products: PromptProducts) -> None:
        for s in self.sinks:
            s.finish(products)


class Assembled:
    """A sink that assembles every target's Jacobian whole, (d_model, n_tokens, d_model) each, in ``jacobians``."""

    def __init__(self, engine: Engine, trace: Trace, targets: Sequence[Target]) -> None:
        d, n = engine.d_model, trace.n_tokens
        self.jacobians = {t: torch.empty(d, n, d, dtype=engine.dtype, device=engine.device) for t in targets}

    def open(self, products: PromptProducts) -> AbstractContextManager[Any]:
        return nullcontext()

    def take(self, block: JacobianBlock) -> None:
        self.jacobians[block.target][block.start:block.stop, block.token_start:block.token_stop] = block.values

    def more(self) -> bool:
        return False

    def finish(self, products: PromptProducts) -> None:
        return None
