"""The frozen system with the first position set aside: the values of every node once the first position's own
contribution is removed.

With every norm scale, gate and attention pattern frozen at the prompt's values, the model is linear (affine for an
affine family) in its sources: the input embeddings and, for an affine family, the constants each layer adds at each
position (the attribution graphs' bias nodes). Setting the first position aside removes its sources, its embedding and
the constants added there: nothing at the first position is left (its residual stream is zero at every layer), and
every later position keeps only what its own sources and those of the positions after the first give it. The system
is the same frozen one, so its Jacobians are unchanged; only the values differ. The first position is the attention
sink of most models: set aside, it stops answering every question about the prediction.

:meth:`FrozenValues.first_aside` runs that system: the factors recorded on the prompt and replayed
(:class:`~detjac.engine.detach.factors.FactorTape`) with the residual stream at the first position zeroed before every
layer and after the last, and gives what an attribution graph reads of it. Guarantees: the same frozen system as the
engine's trace (its values without the zeroing equal the trace's within float64 rounding: tested), from the whole
model in memory; a causal family with dense MLPs. Definitions: docs/graphs.md, "Targets".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from detjac.errors import InvalidArgumentError

from ..detach.factors import FactorTape
from ..detach.model import linearized
from ..interface import Engine
from ..types import Trace
from .intervene import check_whole_model, down_projection

WHAT = "setting the first position aside"


@dataclass(frozen=True)
class FrozenValues:
    """The values of a frozen system on the prompt (each on the engine's device, in its dtype).

    Attributes
    ----------
    neurons : dict[int, torch.Tensor]
        Layer -> (n, n_neurons) every MLP neuron's value (zero at a position set aside).
    inputs : list[torch.Tensor]
        (n, d) the residual stream entering each layer, then leaving the last (``n_layers + 1`` of them).
    output : torch.Tensor
        (d,) the final normed hidden state at the predicted position (what a logit target's vector multiplies).
    embeddings : torch.Tensor
        (n, d) the input embeddings, zero at a position set aside.
    aside : tuple of int
        The positions set aside.
    """

    neurons: dict[int, torch.Tensor]
    inputs: list[torch.Tensor]
    output: torch.Tensor
    embeddings: torch.Tensor
    aside: tuple[int, ...]

    @staticmethod
    def check(engine: Engine, n_tokens: int | None = None) -> None:
        """Refuse, before any work, what :meth:`first_aside` cannot do: an engine without the whole model in
        memory, an encoder, a mixture-of-experts MLP (by its layer), a prompt of one token (nothing would be left)."""
        _down_projections(engine, n_tokens)

    @staticmethod
    def first_aside(engine: Engine, trace: Trace, aside: bool = True) -> FrozenValues:
        """The values of the frozen system of ``trace``'s prompt with its first position set aside (see the module
        docstring); ``aside=False`` runs the same replay without setting anything aside (the prompt's own values).

        Raises
        ------
        InvalidArgumentError, UnsupportedModelError
            As :meth:`check`.
        """
        downs = _down_projections(engine, trace.n_tokens if aside else None)
        family = engine.family
        layers = list(family.layers(family.decoder(engine.model)))
        input_ids = torch.tensor([trace.token_ids], device=engine.device)
        tape = FactorTape()
        with linearized(engine.model, detach=True, convention=engine.convention) as lin, torch.no_grad():
            with tape.recording():
                lin.decoder(input_ids=input_ids, use_cache=False)
            inputs: list[torch.Tensor] = []
            neurons: dict[int, torch.Tensor] = {}
            with tape.replaying_factors(), _zeroed(layers, 1 if aside else 0, inputs), \
                    _recorded(downs, neurons):
                normed = lin.decoder(input_ids=input_ids, use_cache=False).last_hidden_state[0]
        if aside:
            for z in neurons.values():
                z[0] = 0  # the neurons there read only the constants added there, set aside with them
        x = trace.embeddings.clone()
        x[:1 if aside else 0] = 0
        return FrozenValues(neurons, inputs, normed[trace.position].to(engine.dtype), x, (0,) if aside else ())


def _down_projections(engine: Engine, n_tokens: int | None) -> list[Any]:
    """Each layer's MLP down projection (its input: the layer's neuron values), once :meth:`FrozenValues.check`'s
    refusals are passed."""
    check_whole_model(engine, WHAT)
    family = engine.family
    downs = [down_projection(engine, layer, index, WHAT)[0]
             for index, layer in enumerate(family.layers(family.decoder(engine.model)))]
    if n_tokens is not None and n_tokens < 2:
        raise InvalidArgumentError(f"Expected a prompt of at least 2 tokens to set the first position aside. Got "
                                   f"{n_tokens}: nothing would be left to predict from.")
    return downs


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


@contextmanager
def _zeroed(layers: list[Any], count: int, inputs: list[torch.Tensor]) -> Iterator[None]:
    """The residual stream's first ``count`` positions zeroed entering every layer and leaving the last; each
    layer's input and the last one's output appended to ``inputs`` as they pass. Hooks removed on exit, even on
    error."""
    def enter(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        h = _hidden(args, kwargs).clone()
        h[:, :count] = 0
        inputs.append(h[0])
        return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})

    def leave(module: Any, args: tuple[Any, ...], output: Any) -> Any:
        h = (output[0] if isinstance(output, tuple) else output).clone()
        h[:, :count] = 0
        inputs.append(h[0])
        return (h, *output[1:]) if isinstance(output, tuple) else h

    handles = [layer.register_forward_pre_hook(enter, with_kwargs=True) for layer in layers]
    handles.append(layers[-1].register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _recorded(downs: list[Any], neurons: dict[int, torch.Tensor]) -> Iterator[None]:
    """Each layer's neuron values (its MLP's down projection's input) into ``neurons`` as the layer runs."""
    def hook(i: int) -> Any:
        return lambda module, args: neurons.__setitem__(i, args[0][0].detach().clone())

    handles = [down.register_forward_pre_hook(hook(i)) for i, down in enumerate(downs)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
