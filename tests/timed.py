"""A call that might block, run with a time limit: a regression that hangs (a FIFO read, say) fails its test instead
of hanging the suite."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def within(seconds: float, call: Callable[[], Any]) -> dict[str, Any]:
    """``{"value": call()}`` or ``{"error": the exception it raised}``, run in a daemon thread given ``seconds``.

    Raises
    ------
    AssertionError
        ``call`` is still running after ``seconds`` (its thread is left behind, a daemon).
    """
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return out
