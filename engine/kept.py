"""An engine that keeps the last output Jacobian it swept, so that storing a prompt just computed (``detjac jacobian
--out run.zarr``) reads its blocks from memory instead of computing them again."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from detjac.targets import OUTPUTS, Target

from .interface import Engine
from .types import JacobianBlock, Plan, Prompt, Trace


class KeptEngine:
    """``engine`` with a memory of one: the trace and the output Jacobian of the last sweep of the output's blocks
    alone, every row and token. :meth:`trace` of the same tokens at the same position gives that trace back, and
    :meth:`blocks` of it the kept rows in the planned row blocks; everything else is ``engine``'s own (an
    :class:`~detjac.engine.Engine` by registration: every other attribute is the inner engine's)."""

    def __init__(self, engine: Engine) -> None:
        self.inner = engine
        self._kept: tuple[Trace, torch.Tensor] | None = None

    def __getattr__(self, name: str) -> Any:  # the interface's attributes (config, dtype, stats, ...) and methods
        inner = self.__dict__.get("inner")
        if inner is None:  # not initialized (a copy being made): nothing to forward to
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:  # the inner engine's description, under this class's name
        return "<KeptEngine " + repr(self.inner).split(" ", 1)[1]

    def trace(self, prompt: Prompt, *, position: int | None = None, progress: bool = False) -> Trace:
        if self._kept is not None:
            kept = self._kept[0]
            ids = self.inner.token_ids(prompt)
            at = self.family.default_position if position is None else position
            if ids == list(kept.token_ids) and -len(ids) <= at < len(ids) and at % len(ids) == kept.position:
                return kept
        return self.inner.trace(prompt, position=position, progress=progress)

    def blocks(self, trace: Trace, targets: Sequence[Target], plan: Plan | None = None, *,
               progress: bool = False) -> Iterator[JacobianBlock]:
        plan = plan if plan is not None else self.inner.plan(trace, targets)
        output_only = list(targets) == [OUTPUTS] and not plan.forward
        d, n = self.inner.d_model, trace.n_tokens
        if self._kept is not None and trace is self._kept[0] and output_only:
            jac = self._kept[1]
            for start in range(0, d, plan.row_block):
                stop = min(start + plan.row_block, d)
                yield JacobianBlock(OUTPUTS, start, stop, 0, n, jac[start:stop])
            return
        if not output_only:
            yield from self.inner.blocks(trace, targets, plan, progress=progress)
            return
        kept: torch.Tensor | None = None
        covered = 0
        for b in self.inner.blocks(trace, targets, plan, progress=progress):
            if kept is None:
                kept = b.values.new_empty(d, n, d)
            kept[b.start:b.stop, b.token_start:b.token_stop] = b.values
            covered += (b.stop - b.start) * (b.token_stop - b.token_start)
            yield b
            del b  # not held while the next block is computed
        if kept is not None and covered == d * n:
            self._kept = (trace, kept)


Engine.register(KeptEngine)
