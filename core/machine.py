"""What this machine can give (torch-free): the one home of the memory left to a working set no budget was given for
(a graph's adjacency, arrays a file claims)."""

from __future__ import annotations

import os


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
