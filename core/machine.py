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


def available_memory() -> int | None:
    """Bytes of memory this machine can still give without swapping (``MemAvailable`` of ``/proc/meminfo``, else
    free pages from ``sysconf``); None where neither is known."""
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
