"""Progress bars for long engine work (tqdm, only when asked for)."""

from __future__ import annotations

from typing import Any


def progress_bar(items: Any, progress: bool, desc: str, unit: str, leave: bool = True,
                 total: int | None = None) -> Any:
    """``items`` wrapped in a tqdm bar when ``progress`` (a bare bar when ``items`` is None); else ``items``."""
    if not progress:
        return items
    from detjac.progress import tqdm

    return tqdm(items, desc=desc, unit=unit, leave=leave, total=total)
