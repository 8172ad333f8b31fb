"""The layer-streamed engine's Jacobians assembled in memory (:meth:`~detjac.engine.streamed.streamed_engine.
StreamedEngine.jacobians`): small models and tests; stores take the engine's blocks instead. It holds what it is
given and computes nothing but the reconstruction error of each target."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detjac.exactness import relative_error
from detjac.targets import Target

from ..result import reconstruct
from ..types import Plan
from .tracing import StreamedTrace


@dataclass(repr=False)
class StreamedResult:
    """Jacobians by target, with the forward pass they linearize."""

    trace: StreamedTrace
    jacobians: dict[Target, torch.Tensor]
    plan: Plan

    def summary(self) -> dict[str, str]:
        """Tokens and, per target, its Jacobian's shape, dtype and reconstruction error (repr and Jupyter table)."""
        out = {"tokens": str(len(self.trace.token_ids))}
        for t, J in self.jacobians.items():
            out[t.name] = (f"{tuple(J.shape)} {str(J.dtype).removeprefix('torch.')}, reconstruction error "
                           f"{self.reconstruction_error(t):.2e}")
        return out

    def __repr__(self) -> str:
        names = [t.name for t in self.jacobians]
        shown = ", ".join(names[:4]) + (f", … ({len(names)} targets)" if len(names) > 4 else "")
        first = next(iter(self.jacobians.values()), None)
        shape = f"; each {tuple(first.shape)} {str(first.dtype).removeprefix('torch.')}" if first is not None else ""
        return f"<StreamedResult {len(self.trace.token_ids)} tokens: {shown}{shape}>"

    def _repr_html_(self) -> str:
        from ..result import html_table

        return html_table("StreamedResult", self.summary().items())

    def __getitem__(self, name: str | Target) -> torch.Tensor:
        key = name if isinstance(name, Target) else next((t for t in self.jacobians if t.name == name), None)
        if key not in self.jacobians:
            raise KeyError(f"Expected one of {', '.join(t.name for t in self.jacobians)}. Got {name!r}.")
        return self.jacobians[key]

    def reconstruction_error(self, name: str | Target) -> float:
        """``||sum_k J[:, k, :] x_k - value|| / ||value||`` for one target."""
        t = name if isinstance(name, Target) else next(t for t in self.jacobians if t.name == name)
        return relative_error(reconstruct(self.jacobians[t], self.trace.source(t)), self.trace.value(t))
