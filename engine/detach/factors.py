"""Frozen factors, recorded in one forward pass and replayed in another.

Every wrapper computes its factor through :func:`freeze`; a :class:`FactorTape` records and replays them, which gives
an affine model's offset ``b`` from a pass on zero inputs. Details: docs/engine.md, "Frozen factors and the
offset b"."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

from detjac.errors import LinearizationError

T = TypeVar("T")

_ACTIVE: ContextVar[FactorTape | None] = ContextVar("detjac_factor_tape", default=None)


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    return value


def freeze(compute: Callable[[], T], detach: bool) -> T:
    """The factor ``compute()``, detached when ``detach`` is on; recorded or replayed by the active tape."""
    tape = _ACTIVE.get()
    if tape is not None and tape.replaying:
        return tape.next()
    value = compute()
    if detach:
        value = _detached(value)
    if tape is not None:
        tape.factors.append(value)
    return value


class FactorTape:
    """The frozen factors of one forward pass, in call order (see the module docstring)."""

    def __init__(self) -> None:
        self.factors: list[Any] = []
        self.replaying = False
        self._cursor = 0

    def next(self) -> Any:
        if self._cursor >= len(self.factors):
            raise LinearizationError(
                f"Expected the replayed pass to use the {len(self.factors)} frozen factors of the recorded pass. "
                "Got a request for more: the two passes took different paths. Please report this model."
            )
        self._cursor += 1
        return self.factors[self._cursor - 1]

    @contextmanager
    def recording(self) -> Iterator[FactorTape]:
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @contextmanager
    def replaying_factors(self) -> Iterator[FactorTape]:
        token = _ACTIVE.set(self)
        self.replaying, self._cursor = True, 0
        try:
            yield self
        finally:
            self.replaying = False
            _ACTIVE.reset(token)
        if self._cursor != len(self.factors):
            raise LinearizationError(
                f"Expected the replayed pass to use all {len(self.factors)} frozen factors of the recorded pass. "
                f"Got {self._cursor}: the two passes took different paths. Please report this model."
            )
