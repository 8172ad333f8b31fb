"""An engine's MLP neurons on a prompt, derived from its :meth:`~detjac.engine.Engine.walk`: their values, the
residual stream's ends (where an affine family's constants are read), and the refusal of an engine without them.
Used by the attribution graphs (docs/graphs.md)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..interface import Engine
from ..pullback import PullRequest, Seed, check_pull, neuron_activations, neurons_of
from ..types import Trace


def check_neurons(engine: Engine) -> None:
    """Refuse, by name, an engine without neuron sites (:attr:`~detjac.engine.Engine.pullback_sites`).

    Raises
    ------
    InvalidArgumentError
        The engine's autograd sweeps or ordinary Jacobian, which have no frozen neurons.
    """
    probe = PullRequest((Seed(neurons_of(0), torch.zeros(1, 1, 1)),), (neurons_of(0),), d_model=1)
    check_pull([probe], engine.pullback_sites, engine.detach)


def _neuron_walk(engine: Engine, trace: Trace) -> Any:
    """The engine's walk of ``trace`` (a context manager), once :func:`check_neurons` has passed."""
    check_neurons(engine)
    return engine.walk(trace)


def neurons(engine: Engine, trace: Trace, layers: Sequence[int] | None = None
            ) -> Iterator[tuple[int, torch.Tensor, Any]]:
    """``(layer, (n, n_neurons) its MLP neurons' values on the prompt, its MLP piece)`` for ``layers`` (default:
    all), one layer at a time (:func:`detjac.engine.pullback.neuron_activations`); raises InvalidArgumentError for an
    engine without neuron sites (:func:`check_neurons`)."""
    with _neuron_walk(engine, trace) as walk:
        yield from neuron_activations(walk, range(engine.n_layers) if layers is None else layers)


def activations(engine: Engine, trace: Trace, layers: Sequence[int] | None = None
                ) -> Iterator[tuple[int, torch.Tensor]]:
    """``(layer, (n, n_neurons) its MLP neurons' values on the prompt)`` as :func:`neurons` gives them, each layer's
    MLP piece (which holds the layer's widened weights) let go before the next layer is widened."""
    for layer, z, mlp in neurons(engine, trace, layers):
        del mlp
        yield layer, z


def residual_ends(engine: Engine, trace: Trace) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, d) each: the residual stream on the prompt entering the first layer and leaving the last, where an
    affine family's constants outside the layers (position embeddings, the final norm's shift) are read; raises
    InvalidArgumentError for an engine without neuron sites (:func:`check_neurons`)."""
    with _neuron_walk(engine, trace) as walk:
        return walk.residual_ends()
