"""How the layer-streamed sweeps move a block of vectors through one layer: by ``torch.func`` or explicitly.

:func:`make_adjoint` picks :class:`ExplicitAdjoint` (the default: the layer's frozen pieces as GEMMs) or
:class:`AutogradAdjoint` (vmapped ``vjp`` / ``jvp``: the reference, and the fallback); both compute the same map.
Details: docs/engine.md, "Explicit sweeps"."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from detjac.errors import InvalidArgumentError

from ..pieces import NotAPiece
from ..pieces.layer import LayerPieces, PiecesPull, check_layer, push_layer
from ..pieces.norms import NormPiece, frozen_norm
from ..pieces.record import record_layer
from ..pieces.runner import chosen_sweeps
from .skeleton import Skeleton
from .tracing import LayerSteps, StreamedTrace


class AutogradAdjoint:
    """Vectors through one layer by ``torch.func.vjp`` / ``jvp`` vmapped over the block (the reference)."""

    name = "autograd"

    def __init__(self, sk: Skeleton, steps: LayerSteps) -> None:
        self.sk, self.steps = sk, steps

    def sizing(self) -> str:
        """The sweeps the cost model sizes blocks for (:class:`~detjac.engine.cost.CostModel`)."""
        return self.name

    def pull_final(self, trace: StreamedTrace, seed: torch.Tensor) -> torch.Tensor:
        """(B, d) cotangents of the final normed state at the position -> (B, n, d) at the last layer's output."""
        _, pull = torch.func.vjp(self.steps.final(trace.position), trace.inputs[-1].to(self.sk.device))
        with torch.no_grad():
            return torch.func.vmap(pull)(seed)[0]

    def pull_final_every(self, trace: StreamedTrace, seed: torch.Tensor) -> torch.Tensor:
        """(B, n, d) cotangents of the final normed state at every position -> (B, n, d) at the last layer's output
        (each position through its own norm)."""
        _, pull = torch.func.vjp(self.steps.norm, trace.inputs[-1].to(self.sk.device))
        with torch.no_grad():
            return torch.func.vmap(pull)(seed)[0]

    def layer_pull(self, i: int, trace: StreamedTrace, h: torch.Tensor) -> Any:
        """Layer ``i`` (resident) as the pullback primitive crosses it (:class:`~detjac.engine.pullback.LayerPull`):
        here by ``torch.func``, which has no neuron sites and cannot hold the MLP fixed."""
        return AutogradPull(self, i, trace, h, "the autograd sweeps were chosen" if self.steps.detach
                            else "the Jacobian is not detached")

    def push_layer(self, i: int, trace: StreamedTrace, h: torch.Tensor, tangent: torch.Tensor, s: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Tangents (c, n - s, d) at layer ``i``'s input, zero before ``s`` (not carried) -> (the tangents, zeros put
        back in front where a suffix could not run; at the output; at the mid residual; the start used)."""
        c, d = tangent.shape[0], tangent.shape[-1]
        with torch.no_grad():
            step = self.steps.suffix_step(i, trace.calls, h, s) if s > 0 else None
            if step is None:
                if s > 0:  # not truncatable exactly: carry the zeros again
                    tangent = torch.cat([tangent.new_zeros(c, s, d), tangent], dim=1)
                    s = 0
                step = self.steps.step(i, trace.calls)
            hs = h[s:]
            t_out, t_mid = torch.func.vmap(lambda v: torch.func.jvp(step, (hs,), (v,))[1])(tangent)
        return tangent, t_out, t_mid, s

    def push_final(self, trace: StreamedTrace, tangent: torch.Tensor, s: int) -> torch.Tensor:
        """Tangents (c, n - s, d) at the last layer's output -> (c, d) of the final normed state at the position."""
        p = trace.position
        if p < s:
            return tangent.new_zeros(tangent.shape[0], tangent.shape[-1])
        h = trace.inputs[-1][s:].to(self.sk.device)
        with torch.no_grad():
            return torch.func.vmap(lambda v: torch.func.jvp(self.steps.final(p - s), (h,), (v,))[1])(tangent)


class AutogradPull:
    """A layer crossed by ``torch.func`` (see :meth:`AutogradAdjoint.layer_pull`); ``why``: why not by its pieces."""

    def __init__(self, adjoint: AutogradAdjoint, i: int, trace: StreamedTrace, h: torch.Tensor, why: str) -> None:
        self.adjoint, self.i, self.trace, self.input, self.why = adjoint, i, trace, h, why

    def pull(self, g_out: torch.Tensor, g_mid: torch.Tensor | None, s: int, cut: bool) -> tuple[torch.Tensor, int]:
        """Cotangents (B, n, d) at the layer's output and mid residual (None: zero), zero before position ``s``,
        -> (B, n, d) at its input, and the start actually used (0 where a suffix could not run)."""
        if cut:
            self._refuse("holding its MLP fixed")
        steps, calls, h = self.adjoint.steps, self.trace.calls, self.input
        step = steps.pulled_suffix_step(self.i, calls, h, s) if 0 < s < h.shape[0] else None
        if step is None:
            step, s = steps.step(self.i, calls), 0
        if g_mid is None:  # only the output's cotangents: the mid residual is not pulled back
            _, pull = torch.func.vjp(lambda x, step=step: step(x)[0], h)
            cotangents: Any = g_out[:, s:]
        else:
            _, pull = torch.func.vjp(step, h)
            cotangents = (g_out[:, s:], g_mid[:, s:])
        with torch.no_grad():
            return torch.func.vmap(pull)(cotangents)[0], s

    def neuron_cotangents(self, g_out: torch.Tensor) -> torch.Tensor:
        self._refuse("its MLP neurons")

    def neuron_seeds(self, g: torch.Tensor) -> torch.Tensor:
        self._refuse("its MLP neurons")

    def activations(self) -> torch.Tensor:
        self._refuse("its MLP neurons")

    def mlp(self) -> Any:
        self._refuse("its MLP neurons")

    def attention(self) -> Any:
        self._refuse("its attention heads")

    def _refuse(self, what: str) -> Any:
        raise InvalidArgumentError(f"Expected layer {self.i} as explicit pieces for {what}. Got a layer crossed by "
                                   f"torch.func: {self.why}.")


class ExplicitAdjoint(AutogradAdjoint):
    """Vectors through one layer by its pieces' transposes as plain matmuls (see the module docstring)."""

    name = "explicit"

    def __init__(self, sk: Skeleton, steps: LayerSteps) -> None:
        super().__init__(sk, steps)
        self._checked: set[int] = set()  # layers whose pieces rebuilt the layer's own output once
        self._unknown: dict[int, str] = {}  # layers with an unknown piece, and why
        self._warned = False

    def sizing(self) -> str:
        return "autograd" if self._unknown else self.name  # once a layer has fallen back, size for torch.func

    def _fallback(self, where: str, why: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"{self.steps.family.name} {where}: {why}; its sweeps go through torch.func "
                          "(the autograd sweeps) instead of explicit matmuls.", RuntimeWarning, stacklevel=4)

    def _pieces(self, i: int, trace: StreamedTrace, h: torch.Tensor) -> LayerPieces | None:
        if not self.steps.detach or i in self._unknown:
            return None
        own = i in self.sk.owned  # the widened weights are this block's: gains fold into them in place
        try:
            record, out, mid = record_layer(self.sk.layers[i], self.steps.family, self.steps.step(i, trace.calls), h)
            pieces = record.pieces(own)
            if i not in self._checked:
                check_layer(pieces, h, out, mid)
                self._checked.add(i)
        except NotAPiece as e:
            self._unknown[i] = str(e)
            self._fallback(f"layer {i}", str(e))
            if own:  # the folds may have changed the weights: torch.func gets the layer as stored
                self.sk.rewiden(i)
            return None
        self.sk.stats.explicit_layers += 1
        return pieces

    def pull_final(self, trace: StreamedTrace, seed: torch.Tensor) -> torch.Tensor:
        p, h = trace.position, trace.inputs[-1].to(self.sk.device)
        norm = self._final_norm(h[p:p + 1])
        if norm is None:
            return super().pull_final(trace, seed)
        g = seed.new_zeros(seed.shape[0], h.shape[0], h.shape[1])
        g[:, p] = norm.transpose(seed[:, None])[:, 0]
        return g

    def pull_final_every(self, trace: StreamedTrace, seed: torch.Tensor) -> torch.Tensor:
        norm = self._final_norm(trace.inputs[-1].to(self.sk.device))
        return super().pull_final_every(trace, seed) if norm is None else norm.transpose(seed)

    def push_final(self, trace: StreamedTrace, tangent: torch.Tensor, s: int) -> torch.Tensor:
        p, h = trace.position, trace.inputs[-1].to(self.sk.device)
        norm = self._final_norm(h[p:p + 1])
        if norm is None or p < s:
            return super().push_final(trace, tangent, s)
        return norm.apply(tangent[:, p - s][:, None])[:, 0]

    def _final_norm(self, h: torch.Tensor) -> NormPiece | None:
        """The final norm at ``h`` (m, d) as a piece; None where the sweeps are not detached or it is not a known
        piece (the caller goes through torch.func; the first such fallback warns)."""
        if not self.steps.detach:
            return None
        try:
            return frozen_norm(self.sk.decoder.norm, h)
        except NotAPiece as e:
            self._fallback("final norm", str(e))
            return None

    def layer_pull(self, i: int, trace: StreamedTrace, h: torch.Tensor) -> Any:
        pieces = self._pieces(i, trace, h)
        if pieces is None:
            why = self._unknown.get(i, "the Jacobian is not detached")
            return AutogradPull(self, i, trace, h, why)
        return CountedPull(pieces, self.sk.stats, trace.mids[i].to(self.sk.device) if trace.mids else None, h)

    def push_layer(self, i: int, trace: StreamedTrace, h: torch.Tensor, tangent: torch.Tensor, s: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        pieces = self._pieces(i, trace, h)
        if pieces is None:
            return super().push_layer(i, trace, h, tangent, s)
        if s > 0 and not all(getattr(c, "causal_from", lambda s: True)(s) for c in (pieces.attention, pieces.mlp)):
            tangent = torch.cat([tangent.new_zeros(tangent.shape[0], s, tangent.shape[2]), tangent], dim=1)
            s = 0
        if s > 0:
            self.sk.stats.suffix_layers += 1
        with torch.no_grad():
            t_out, t_mid = push_layer(pieces, tangent, s)
        return tangent, t_out, t_mid, s


class CountedPull(PiecesPull):
    """A layer's pieces crossed by the sweep, counting the pullbacks that started past position 0."""

    def __init__(self, pieces: LayerPieces, stats: Any, mid: torch.Tensor | None = None,
                 input: torch.Tensor | None = None) -> None:
        super().__init__(pieces, mid, input)
        self.stats = stats

    def pull(self, g_out: torch.Tensor, g_mid: torch.Tensor | None, s: int, cut: bool) -> tuple[torch.Tensor, int]:
        s = 0 if s >= g_out.shape[1] else s
        if s > 0:
            self.stats.pulled_suffix_layers += 1
        return super().pull(g_out, g_mid, s, cut)


def make_adjoint(sk: Skeleton, steps: LayerSteps, sweeps: str | None = None) -> AutogradAdjoint:
    """The sweeps' way through a layer (:func:`chosen_sweeps`).

    Raises
    ------
    InvalidArgumentError
        Another name.
    """
    return (ExplicitAdjoint if chosen_sweeps(sweeps) == "explicit" else AutogradAdjoint)(sk, steps)
