"""A call that might block or grow without end, run in a child process with a time limit and a memory cap: a
regression that hangs (a FIFO read) or reads without end (``/dev/zero``) fails its test instead of hanging the suite
or exhausting the machine's memory."""

from __future__ import annotations

import multiprocessing
import os
import resource
from collections.abc import Callable
from typing import Any

EXTRA_BYTES = 512 * 2**20  # address space the child may add to what it inherits


def _child(call: Callable[[], Any], sink: Any) -> None:
    with open("/proc/self/statm") as handle:  # the address space inherited, in pages
        inherited = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)  # a shell's `ulimit -v` may have set one: kept
    soft = inherited + EXTRA_BYTES if hard == resource.RLIM_INFINITY else min(inherited + EXTRA_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    try:
        sink.send({"value": call()})
    except BaseException as exc:  # noqa: BLE001 - handed back to the test
        sink.send({"error": exc})


def within(seconds: float, call: Callable[[], Any]) -> dict[str, Any]:
    """``{"value": call()}`` or ``{"error": the exception it raised}`` (both pickled back), run in a forked child
    given ``seconds`` and :data:`EXTRA_BYTES` of memory beyond what it inherits.

    Raises
    ------
    AssertionError
        ``call`` is still running after ``seconds`` (the child is killed) or its child died without an answer.
    """
    parent, child = multiprocessing.get_context("fork").Pipe(duplex=False)
    process = multiprocessing.get_context("fork").Process(target=_child, args=(call, child), daemon=True)
    process.start()
    child.close()
    try:
        ready = parent.poll(seconds)
        assert ready, f"still running after {seconds} s"
        return parent.recv()
    except EOFError:
        process.join(5)
        raise AssertionError(f"the child died without an answer (exit code {process.exitcode})") from None
    finally:
        process.kill()
        process.join()
