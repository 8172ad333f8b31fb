"""This machine and this process as benchmarks and checks record them: the CPU's name, the process's peak
resident memory, and the memory left to a working set no budget was given for (a graph's adjacency, arrays a file
claims) (Linux ``/proc``, with portable fallbacks). Standard library only, so every layer and every benchmark can
import it."""

from __future__ import annotations

import functools
import os
import platform
import resource
from pathlib import Path


@functools.cache
def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the architecture where that is unreadable). Speed and the last bits
    of float64 results depend on it, and a benchmark resumed in another session may run on another CPU."""
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def host() -> str:
    """The CPU's model name and core count, as a measurement's record names the machine that computed it: times and
    the last bits of float64 results (BLAS kernels round differently) depend on it."""
    return f"{cpu_name()}, {os.cpu_count()} cores"


def peak_mib() -> float:
    """This process's peak resident set (VmHWM), MiB.

    Not ``getrusage``'s ``ru_maxrss``: Linux carries that over from the parent through
    fork and exec, so a child started by a parent that once held more would report the
    parent's peak.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # elsewhere: KiB (Linux) / bytes (macOS)


def reset_peak() -> float:
    """Reset this process's peak resident set to its current one (Linux ``clear_refs``) and return it, MiB.

    Measuring "peak above a base" against an old high-water mark would hide every run that stays
    below what building the model once needed. Where the reset is not allowed: the old high-water mark.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return peak_mib()


_CAP: list[int | None] = [None]  # this process's share of the machine (a dask worker's memory limit), bytes


def set_memory_cap(limit: int | None) -> None:
    """Cap what :func:`available_memory` reports for this process at ``limit`` bytes less its resident set: a
    worker of several on one machine (``detjac run --workers N``) sizes its unbudgeted working sets from its own
    share, not from memory its siblings will also count as free. None removes the cap."""
    _CAP[0] = int(limit) if limit else None


def resident_bytes() -> int | None:
    """This process's resident set now (VmRSS), bytes; None where unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory() -> int | None:
    """Bytes of memory this process can still take without swapping: the machine's (``MemAvailable`` of
    ``/proc/meminfo``, else free pages from ``sysconf``), and at most its cap (:func:`set_memory_cap`) less its
    resident set; None where neither is known."""
    free = _machine_available()
    if _CAP[0] is None:
        return free
    share = max(0, _CAP[0] - (resident_bytes() or 0))
    return share if free is None else min(free, share)


def _machine_available() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):
        return None
