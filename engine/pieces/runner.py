"""The layer runner both engines share: one decoder layer run on one prompt's hidden states, and which way
blocks of vectors cross a layer (``explicit`` matmuls of the recorded pieces, or ``autograd``: ``torch.func``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from detjac.errors import InvalidArgumentError

SWEEPS = ("explicit", "autograd")
SWEEPS_ENV = "DETJAC_SWEEPS"


def run_layer(call: Callable[[torch.Tensor], Any], mid_module: nn.Module | None, h: torch.Tensor
              ) -> tuple[Any, torch.Tensor, list[torch.Tensor]]:
    """Run one decoder layer (``call`` on a batch of one) on ``h`` (n, d), seeing its mid residual as the input of
    ``mid_module``: (the layer's raw result, its output (n, d), the mid residuals seen, each (1, n, d))."""
    seen: list[torch.Tensor] = []
    handle = mid_module.register_forward_pre_hook(lambda _m, a: seen.append(a[0])) if mid_module is not None else None
    try:
        raw = call(h[None])
    finally:
        if handle is not None:
            handle.remove()
    out = raw[0] if isinstance(raw, tuple) else raw
    # squeeze, not [0]: its pullback is a view, where indexing's writes into a zeroed buffer per vector
    return raw, out.squeeze(0), seen


def chosen_sweeps(sweeps: str | None = None) -> str:
    """``sweeps`` (``explicit`` or ``autograd``), by default the ``DETJAC_SWEEPS`` environment variable's, else
    ``explicit``: how every engine moves blocks of vectors through a detached layer.

    Raises
    ------
    InvalidArgumentError
        Another name.
    """
    chosen = sweeps if sweeps is not None else os.environ.get(SWEEPS_ENV) or "explicit"
    if chosen not in SWEEPS:
        origin = "sweeps" if sweeps is not None else SWEEPS_ENV
        raise InvalidArgumentError(f"Expected {origin} one of {', '.join(SWEEPS)}. Got {chosen!r}.")
    return chosen
