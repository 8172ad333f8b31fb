"""Progress bars: tqdm's on a terminal; elsewhere plain lines.

Where stderr is not a terminal (batch schedulers, ``nohup``, CI logs, notebooks) :func:`tqdm` returns a
:class:`PlainBar`, which writes whole lines, at most one per ``DETJAC_PROGRESS_INTERVAL`` seconds (default 30).
Torch-free: every layer may use it."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TextIO

_LABEL: ContextVar[str] = ContextVar("detjac_progress_label", default="")


@contextmanager
def labelled(label: str) -> Iterator[None]:
    """Bars made inside the block carry ``label`` before their own description (``detached Jacobian: row blocks``):
    a caller that runs the same pass twice (the detached and the ordinary Jacobian) tells the two apart on screen,
    without the engine that draws the bars knowing."""
    token = _LABEL.set(label)
    try:
        yield
    finally:
        _LABEL.reset(token)


def on_terminal(stream: Any = None) -> bool:
    """Whether ``stream`` (default: stderr, where bars go) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def tqdm(iterable: Iterable[Any] | None = None, *, desc: str | None = None, unit: str = "it",
         total: int | None = None, leave: bool = True, disable: bool = False) -> Any:
    """A progress bar with tqdm's interface: tqdm's own on a terminal (or when disabled), else a :class:`PlainBar`;
    labelled by an enclosing :func:`labelled`."""
    label = _LABEL.get()
    if label:
        desc = f"{label}: {desc}" if desc else label
    if disable or on_terminal():
        from tqdm import tqdm as terminal_bar  # not tqdm.auto: in a kernel it wants ipywidgets (TqdmWarning)

        return terminal_bar(iterable, desc=desc, unit=unit, total=total, leave=leave, disable=disable)
    return PlainBar(iterable, desc=desc, unit=unit, total=total, leave=leave)



def progress_bar(items: Any, progress: bool, desc: str, unit: str, leave: bool = True,
                 total: int | None = None) -> Any:
    """``items`` wrapped in a bar (:func:`tqdm`) when ``progress`` (a bare bar when ``items`` is None); else
    ``items``."""
    return tqdm(items, desc=desc, unit=unit, leave=leave, total=total) if progress else items

class PlainBar:
    """What a bar reports, as whole lines on ``file`` (stderr): no carriage returns, no cursor movement.

    Implements the part of tqdm's interface detjac uses: iteration, ``update``, ``reset``,
    ``set_postfix``, ``close`` and the context manager.
    """

    def __init__(self, iterable: Iterable[Any] | None = None, *, desc: str | None = None, unit: str = "it",
                 total: int | None = None, leave: bool = True, interval: float | None = None,
                 file: TextIO | None = None) -> None:
        self.iterable, self.desc, self.unit, self.leave = iterable, desc or "", unit, leave
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.n, self.postfix, self.closed = total, 0, "", False
        self._shown: tuple[int, str] | None = None  # the count and postfix of the last line written
        self.interval = float(os.environ.get("DETJAC_PROGRESS_INTERVAL", 30)) if interval is None else interval
        self.file = file
        self.start = self._last = time.monotonic()

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable or ():
            yield item
            self.update()

    def __enter__(self) -> PlainBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self._last >= self.interval:
            self._line()

    def reset(self, total: int | None = None) -> None:
        self.n, self.total = 0, total

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        # a bar that counted nothing (a refusal, a run with nothing to do) says nothing
        if not self.closed and self.leave and self.n and self._shown != (self.n, self.postfix):
            self._line()
        self.closed = True

    def _line(self) -> None:
        self._last, self._shown = time.monotonic(), (self.n, self.postfix)
        done = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        percent = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        extra = f", {self.postfix}" if self.postfix else ""
        line = f"{self.desc}: {done} {self.unit}{percent} in {self._last - self.start:.1f} s{extra}"
        print(line, file=self.file or sys.stderr, flush=True)
