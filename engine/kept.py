"""An engine that keeps the last output Jacobian it assembled, so that storing a prompt just computed (``detjac
jacobian --out run.zarr``) reads its blocks from memory instead of computing them again."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from detjac.targets import OUTPUTS, Target

from .interface import Engine, JacobianBlock, Plan, Prompt, Trace
from .pullback import PullRequest, Site


class KeptEngine(Engine):
    """``engine`` with a memory of one: the trace and the output Jacobian of the last :meth:`assemble` of the output
    alone. :meth:`trace` of the same tokens at the same position gives that trace back, and :meth:`blocks` of it
    the kept rows in the planned row blocks; everything else is ``engine``'s own."""

    def __init__(self, engine: Engine) -> None:
        self.inner = engine
        self._kept: tuple[Trace, torch.Tensor] | None = None

    def __getattr__(self, name: str) -> Any:  # the interface's attributes (config, dtype, stats, ...) and the rest
        inner = self.__dict__.get("inner")
        if inner is None:  # not initialized (a copy being made): nothing to forward to
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def tokenizer(self) -> Any | None:
        return self.inner.tokenizer

    @property
    def context(self) -> int:
        return self.inner.context

    def prompt_model(self) -> Any:
        return self.inner.prompt_model()

    def trace(self, prompt: Prompt, *, position: int | None = None, progress: bool = False) -> Trace:
        if self._kept is not None:
            kept = self._kept[0]
            ids = self.token_ids(prompt)
            at = self.family.default_position if position is None else position
            if ids == list(kept.token_ids) and -len(ids) <= at < len(ids) and at % len(ids) == kept.position:
                return kept
        return self.inner.trace(prompt, position=position, progress=progress)

    def plan(self, trace: Trace, targets: Sequence[Target], *, mode: str = "auto", row_block: int | None = None,
             token_block: int | None = None) -> Plan:
        return self.inner.plan(trace, targets, mode=mode, row_block=row_block, token_block=token_block)

    def blocks(self, trace: Trace, targets: Sequence[Target], plan: Plan | None = None, *,
               progress: bool = False) -> Iterator[JacobianBlock]:
        plan = plan if plan is not None else self.plan(trace, targets)
        if self._kept is not None and trace is self._kept[0] and list(targets) == [OUTPUTS] and not plan.forward:
            jac, n = self._kept[1], trace.n_tokens
            for start in range(0, self.d_model, plan.row_block):
                stop = min(start + plan.row_block, self.d_model)
                yield JacobianBlock(OUTPUTS, start, stop, 0, n, jac[start:stop])
            return
        yield from self.inner.blocks(trace, targets, plan, progress=progress)

    def assemble(self, trace: Trace, targets: Sequence[Target], plan: Plan, *,
                 progress: bool = False) -> dict[Target, torch.Tensor]:
        out = self.inner.assemble(trace, targets, plan, progress=progress)
        if list(targets) == [OUTPUTS]:
            self._kept = (trace, out[OUTPUTS])
        return out

    def push(self, trace: Trace, tangents: torch.Tensor) -> torch.Tensor:
        return self.inner.push(trace, tangents)

    def pull(self, trace: Trace, cotangents: torch.Tensor) -> torch.Tensor:
        return self.inner.pull(trace, cotangents)

    @property
    def pullback_sites(self) -> frozenset[str]:
        return self.inner.pullback_sites

    @property
    def explicit_sweeps(self) -> bool:
        return self.inner.explicit_sweeps

    def pulls(self, trace: Trace, requests: Sequence[PullRequest]) -> Iterator[tuple[int, Site, torch.Tensor]]:
        return self.inner.pulls(trace, requests)

    def neurons(self, trace: Trace, layers: Sequence[int] | None = None) -> Iterator[tuple[int, torch.Tensor, Any]]:
        return self.inner.neurons(trace, layers)

    def residual_ends(self, trace: Trace) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.residual_ends(trace)

    def decoding_matrices(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return self.inner.decoding_matrices(dtype)

    def decoding_rows(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        return self.inner.decoding_rows(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(hidden)

    def memory_budget(self, device: str) -> int | None:
        return self.inner.memory_budget(device)

    def sweep_memory(self, n_tokens: int) -> tuple[int | None, int]:
        return self.inner.sweep_memory(n_tokens)

    def record(self, plan: Plan) -> dict[str, Any]:
        return self.inner.record(plan)

    def parameter_count(self) -> int:
        return self.inner.parameter_count()

    def ordinary(self) -> Engine:
        return self.inner.ordinary()

    def stock_logits(self, token_ids: Sequence[int], position: int) -> torch.Tensor:
        return self.inner.stock_logits(token_ids, position)
