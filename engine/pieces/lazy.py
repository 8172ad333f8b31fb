"""A layer widened a matrix at a time: each linear weight stays in its stored form and is widened just before its use.

Where the cost model says so (:meth:`~detjac.engine.cost.CostModel.per_matrix`), the skeleton does not widen
a layer's linear weights when the layer is loaded: each ``nn.Linear`` gets a :class:`LazyWeight` and a pair of hooks
that widen its weight for the duration of its forward call and put it back on ``meta`` afterwards, and the explicit
pieces (:mod:`.layer`) take the :class:`LazyWeight` itself (``projection``), fold the norm gains
into it as operations, and call :meth:`LazyWeight.widened` where they use the matrix. The values are those of
:func:`~detjac.engine.checkpoints.stored.widen`, the gains multiplied in the same order: the same numbers as a layer
widened whole. Details: docs/engine.md, "Stored dtype"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

ATTR = "_detjac_lazy"  # where a linear module holds its LazyWeight while its layer is loaded a matrix at a time


@dataclass(frozen=True)
class LazyWeight:
    """A matrix as stored, widened (``make``: a tensor in the compute dtype, on the compute device) only when asked,
    then cut to ``rows`` and multiplied by ``gains`` (folded norm gains, broadcast, in order), each time anew."""

    make: Callable[[], torch.Tensor]
    shape: tuple[int, ...]
    stored: Any = None  # the stored tensor: a widened tensor that is it (same dtype) is copied before a gain
    rows: slice | None = None
    gains: tuple[torch.Tensor, ...] = ()
    count: Callable[[], None] | None = None

    def __getitem__(self, rows: slice) -> LazyWeight:
        assert isinstance(rows, slice) and self.rows is None, "one slice of rows"
        return replace(self, rows=rows, shape=(len(range(self.shape[0])[rows]), *self.shape[1:]))

    def scaled(self, gain: torch.Tensor) -> LazyWeight:
        """This matrix times ``gain`` (broadcast), applied when it is widened."""
        return replace(self, gains=(*self.gains, gain))

    def widened(self) -> torch.Tensor:
        """The matrix in the compute dtype: a new tensor (or the stored one, where no gain applies and the dtypes
        agree), which the caller drops after its use."""
        t = self.make()
        if self.count is not None:
            self.count()
        if self.rows is not None:
            t = t[self.rows]
        if self.gains and _same(t, self.stored):
            t = t.clone()
        for gain in self.gains:
            t = t.mul_(gain)
        return t


def wide(weight: Any) -> torch.Tensor:
    """``weight`` as a tensor: widened now where it is a :class:`LazyWeight`."""
    return weight.widened() if isinstance(weight, LazyWeight) else weight


def _same(t: torch.Tensor, stored: Any) -> bool:
    return isinstance(stored, torch.Tensor) and t.device == stored.device and \
        t.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr()


def is_lazy(module: nn.Module, attr: str, stored: Any) -> bool:
    """Whether a layer loaded a matrix at a time leaves this parameter as stored: a linear module's 2-D weight."""
    return isinstance(module, nn.Linear) and attr == "weight" and len(getattr(stored, "shape", ())) == 2


def attach(module: nn.Linear, weight: LazyWeight) -> list[Any]:
    """Give ``module`` its :class:`LazyWeight`: its weight is widened when the module is called and put back on
    ``meta`` when the call returns (an error leaves it until the layer is released). Returns the hooks' handles."""
    setattr(module, ATTR, weight)
    meta = module._parameters["weight"]

    def before(m: nn.Module, args: Any) -> None:
        m._parameters["weight"] = nn.Parameter(weight.widened(), requires_grad=False)

    def after(m: nn.Module, args: Any, out: Any) -> None:
        m._parameters["weight"] = meta

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def detach_all(modules: list[nn.Module], handles: list[Any]) -> None:
    """Undo :func:`attach` on ``modules``."""
    for h in handles:
        h.remove()
    for m in modules:
        if ATTR in m.__dict__:
            delattr(m, ATTR)
