"""Tracing and replay for the layer-streamed engine: the forward pass, and each layer as a function.

:func:`trace` runs the forward pass layer by layer and keeps what the sweeps need; :class:`LayerSteps` turns a layer
into a function of its input, whole or on a suffix of the positions (exact because the layer is causal). Details:
docs/engine.md, "The skeleton and the trace"."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from detjac.errors import InvalidArgumentError
from detjac.progress import progress_bar
from detjac.targets import RESID_MID, Target

from ..detach.wrappers import AttentionReplay
from ..pieces.runner import run_layer
from ..types import Trace
from .skeleton import Skeleton

Calls = list[tuple[tuple[Any, ...], dict[str, Any]]]
Step = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StreamedTrace(Trace):
    """A :class:`~detjac.engine.interface.Trace` with every layer's states, for layerwise targets.

    ``norm`` is the linearized final norm, (..., d) -> (..., d), each vector's scale frozen at its own value
    (the ``*_normed`` targets' map); set by :meth:`~detjac.engine.streamed.streamed_engine.StreamedEngine.trace`.
    """

    inputs: list[torch.Tensor] = field(default_factory=list)  # inputs[l]: layer l's input (n, d); [L]: the output
    mids: list[torch.Tensor] = field(default_factory=list)  # mids[l]: residual between attention and MLP (n, d)
    calls: Calls = field(repr=False, default_factory=list)
    norm: Callable[[torch.Tensor], torch.Tensor] | None = field(repr=False, default=None)

    def base_value(self, t: Target) -> torch.Tensor:
        """(d,) the residual-stream vector at the position that a (normed) target is taken of."""
        p, base = self.position, t.base
        if base == "layer":
            return self.inputs[t.layer + 1][p]
        if base == "attn":
            return self.mids[t.layer][p] - self.inputs[t.layer][p]
        if base == "mlp":
            return self.inputs[t.layer + 1][p] - self.mids[t.layer][p]
        if base == RESID_MID:
            return self.mids[t.layer][p]
        raise KeyError(f"Expected a residual-stream target. Got {t.name!r}.")

    def value(self, t: Target) -> torch.Tensor:
        """The target's value at the position (what its Jacobian must reconstruct)."""
        if t.is_output or t.is_to_output:
            return self.output
        v = self.base_value(t)
        if t.normed:
            assert self.norm is not None, "a StreamedTrace from StreamedEngine.trace carries the final norm"
            return self.norm(v)
        return v

    def source(self, t: Target) -> torch.Tensor:
        """(n, d): the vectors the target's Jacobian acts on."""
        if t.is_to_output:
            return self.inputs[t.layer + 1]
        return self.inputs[t.layer] if t.local else self.embeddings


class LayerSteps:
    """Decoder layers of a linearized skeleton as functions of their input (see the module docstring)."""

    def __init__(self, skeleton: Skeleton, family: Any, detach: bool) -> None:
        self.sk, self.family, self.detach = skeleton, family, detach

    def step(self, i: int, calls: Calls) -> Step:
        """Layer ``i`` as a function (n, d) -> (output (n, d), mid residual (n, d))."""
        return self._layer_fn(i, *calls[i])

    def final(self, position: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The final norm at ``position``: (n, d) -> (d,)."""
        return lambda h: self.sk.decoder.norm(h)[position]

    def norm(self, v: torch.Tensor) -> torch.Tensor:
        """The final norm of vectors (..., d), each with its scale frozen at its own value (when detaching)."""
        return self.sk.decoder.norm(v)

    def norm_matrix(self, v: torch.Tensor) -> torch.Tensor:
        """(d, d): the final norm's Jacobian at the vector ``v`` (d,): ``norm(v) = M v`` once its scale is frozen
        (``diag(g / rms(v))`` for an RMSNorm). The ``*_normed`` targets' Jacobians are ``M`` times the
        un-normed ones."""
        with torch.no_grad():
            return torch.func.jacrev(self.norm)(v)

    def _layer_fn(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Step:
        layer = self.sk.layers[i]
        mid_module = getattr(layer, self.family.mid_residual)

        def step(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            _, out, seen = run_layer(lambda x: layer(x, *args, **kwargs), mid_module, h)
            return out, seen[0].squeeze(0)

        return step

    def _suffix_fn(self, i: int, calls: Calls, n: int, start: int) -> Step | None:
        """Layer ``i`` on positions ``start:``, to run under an :class:`AttentionReplay`'s ``replay``; None where
        running a suffix would not be exact: not detaching, or arguments it cannot slice."""
        args, kwargs = calls[i]
        sliced = suffix_kwargs(kwargs, start, n)
        if not self.detach or args or sliced is None:
            return None
        return self._layer_fn(i, args, sliced)

    def suffix_step(self, i: int, calls: Calls, h: torch.Tensor, start: int) -> Step | None:
        """Layer ``i`` on positions ``start:`` only, (n - start, d) -> (n - start, d) twice, for tangents that
        are zero before ``start``; None where that would not be exact (see :meth:`_suffix_fn`), or where the
        layer is not causal (checked on the recorded probabilities).

        One full-length forward of the layer records the attention's values and frozen probabilities;
        the suffix then runs with the prefix's values (constants) and its own probability rows. Exact
        because the layer is causal and every other factor is position-wise.
        """
        step = self._suffix_fn(i, calls, h.shape[0], start)
        if step is None:
            return None
        replay = AttentionReplay()
        with replay.record(), torch.no_grad():
            self.step(i, calls)(h)
        if not replay.records or not replay.causal():
            return None
        self.sk.stats.suffix_layers += 1

        def suffix(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with replay.replay(start):
                return step(hs)

        return suffix

    def pulled_suffix_step(self, i: int, calls: Calls, h: torch.Tensor, start: int) -> Step | None:
        """Layer ``i`` as a function of all its input positions, (n, d) -> the outputs of positions ``start:``,
        (n - start, d) twice, for cotangents that are zero before ``start``; None where a suffix cannot run
        (see :meth:`_suffix_fn`).

        The function runs the layer at full length once, keeping the attention's values as functions of
        the input, then the suffix with them: the pullback goes through the value projections of every
        position but through the output projection and the MLP of the suffix only (the full run's other
        outputs are not used, so nothing is pulled back through them). A layer whose recorded
        probabilities are not causal gives the full run's outputs at ``start:`` instead (exact too).
        """
        step = self._suffix_fn(i, calls, h.shape[0], start)
        if step is None:
            return None
        full = self.step(i, calls)

        def pulled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            replay = AttentionReplay()
            with replay.record(live=True):
                out, mid = full(x)
            if not replay.records or not replay.causal():
                return out[start:], mid[start:]
            self.sk.stats.pulled_suffix_layers += 1
            with replay.replay(start):
                return step(x[start:])

        return pulled


def record_calls(sk: Skeleton, x: torch.Tensor) -> Calls:
    """The arguments the decoder passes each layer (masks, position tables), without running any layer."""
    calls: Calls = []

    def record(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append((args, kwargs))
        return hidden

    patched = [*sk.layers, sk.decoder.norm]
    own = [module.__dict__.get("forward") for module in patched]  # a forward already set on an instance stays
    for module in patched:
        module.forward = record if module is not sk.decoder.norm else (lambda h: h)
    try:
        with torch.no_grad():
            sk.decoder(inputs_embeds=x[None], use_cache=False)
    finally:
        for module, forward in zip(patched, own, strict=True):
            if forward is None:
                del module.forward
            else:
                module.forward = forward
    return calls


def trace(sk: Skeleton, steps: LayerSteps, ids: Sequence[int], position: int, progress: bool = False
          ) -> StreamedTrace:
    """Run the forward pass of ``ids`` layer by layer; keep each layer's input and mid residual."""
    n = len(ids)
    if not -n <= position < n:
        raise InvalidArgumentError(f"Expected a position in [-{n}, {n}). Got {position} instead.")
    x = sk.embed(ids)
    calls = record_calls(sk, x)
    inputs, mids, h = [x], [], x
    for i in progress_bar(range(sk.n_layers), progress, "forward pass", "layer", leave=False):
        with sk.layer(i), torch.no_grad():
            h, mid = steps.step(i, calls)(h)
        inputs.append(h)
        mids.append(mid)
    with torch.no_grad():
        output = steps.final(position)(h)
    return StreamedTrace(list(ids), position % n, x, output, None, inputs, mids, calls)


def suffix_kwargs(kwargs: dict[str, Any], start: int, n: int) -> dict[str, Any] | None:
    """A decoder layer's keyword arguments for positions ``start:`` only; None for one it does not know."""
    out: dict[str, Any] = {}
    for key, v in kwargs.items():
        if v is None or isinstance(v, bool):
            out[key] = v
        elif key == "attention_mask" and isinstance(v, torch.Tensor) and v.shape[-2:] == (n, n):
            out[key] = v[..., start:, :]
        elif key == "position_ids" and isinstance(v, torch.Tensor) and v.shape[-1] == n:
            out[key] = v[..., start:]
        elif key == "position_embeddings" and isinstance(v, tuple) and all(
                isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] == n for t in v):
            out[key] = tuple(t[:, start:] for t in v)
        else:
            return None
    return out

