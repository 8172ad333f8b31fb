"""Scalar nonlinearities written as ``f(z) = z * r(z)``, with the ratio ``r`` frozen (activations, soft-capping).

Each ratio is in closed form from the stock module's formula; activations are matched by exact class, and anything
else has no ratio (the guard refuses it). Details: docs/engine.md, "Scalar nonlinearities"."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from transformers import activations as act

Ratio = Callable[[torch.Tensor], torch.Tensor]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_erf_ratio(z: torch.Tensor) -> torch.Tensor:
    """``Phi(z) = (1 + erf(z / sqrt 2)) / 2``: GELU(z) = z * Phi(z)."""
    return 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))


def gelu_tanh_ratio(z: torch.Tensor) -> torch.Tensor:
    """``(1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))) / 2``: the tanh approximation (gelu_new, gelu_pytorch_tanh)."""
    return 0.5 * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * torch.pow(z, 3.0))))


def gelu_fast_ratio(z: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_fast``: ``(1 + tanh(0.7978845608 z (1 + 0.044715 z^2))) / 2``."""
    return 0.5 * (1.0 + torch.tanh(z * 0.7978845608 * (1.0 + 0.044715 * z * z)))


def quick_gelu_ratio(z: torch.Tensor) -> torch.Tensor:
    """``sigmoid(1.702 z)``."""
    return torch.sigmoid(1.702 * z)


def relu_ratio(z: torch.Tensor) -> torch.Tensor:
    """``[z > 0]``: ReLU(z) = z * [z > 0]."""
    return (z > 0).to(z.dtype)


def softcap_ratio(cap: float) -> Ratio:
    """``c tanh(z / c) / z`` (1 at z = 0, its limit): soft-capping as ``z * ratio``."""

    def ratio(z: torch.Tensor) -> torch.Tensor:
        nonzero = z != 0
        safe = torch.where(nonzero, z, torch.ones_like(z))  # no 0/0, not even in the unused branch
        return torch.where(nonzero, torch.tanh(safe / cap) * cap / safe, torch.ones_like(z))

    return ratio


def _gelu_module_ratio(module: nn.Module) -> Ratio | None:
    return {"none": gelu_erf_ratio, "tanh": gelu_tanh_ratio}.get(getattr(module, "approximate", None))


# Exact class -> ratio (or a function of the instance giving one, for modules with a mode attribute).
_ACTIVATION_RATIOS: dict[type[nn.Module], Ratio | Callable[[nn.Module], Ratio | None]] = {
    act.GELUActivation: gelu_erf_ratio,
    act.GELUTanh: gelu_tanh_ratio,
    act.NewGELUActivation: gelu_tanh_ratio,
    act.FastGELUActivation: gelu_fast_ratio,
    act.QuickGELUActivation: quick_gelu_ratio,
    act.SiLUActivation: torch.sigmoid,
    nn.SiLU: torch.sigmoid,
    nn.ReLU: relu_ratio,
}
_BY_INSTANCE = {nn.GELU: _gelu_module_ratio}


def activation_ratio(module: nn.Module) -> Ratio | None:
    """The frozen ratio ``r`` with ``module(z) = z * r(z)``, or None if detjac has no rule for it."""
    if type(module) in _BY_INSTANCE:
        return _BY_INSTANCE[type(module)](module)
    return _ACTIVATION_RATIOS.get(type(module))  # type: ignore[return-value]


def supported_activations() -> list[str]:
    """Class names of the activations with a ratio rule (for messages)."""
    return sorted(c.__name__ for c in (*_ACTIVATION_RATIOS, *_BY_INSTANCE))
