"""The zarr backend's analysis cache: each result a sealed group ``analysis/<prompt_id>/<name>``, replaced whole."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import format as fmt
from ..analysis_cache import AnalysisCache
from ..integrity import NAME, check_name, check_prompt_id, refuse_links
from .disk import disk_error
from .sealed import read_sealed, write_sealed

if TYPE_CHECKING:
    from ..reader import StoreReader


class ZarrAnalyses(AnalysisCache):
    """The analysis results kept in the store folder of ``store`` (results of its complete prompts only)."""

    def __init__(self, store: StoreReader) -> None:
        self.store = store

    def write(self, prompt_id: str, name: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        """Store a result of a prompt under ``analysis/<prompt_id>/<name>`` (replaced atomically)."""
        check_name(name, "an analysis result name")
        self.store.get(prompt_id)  # the prompt must exist
        what = f"write analysis {name} of prompt {prompt_id}"
        try:
            folder = refuse_links(self.store.path, fmt.ANALYSIS)
            fmt.ensure_group(folder)
            folder = refuse_links(self.store.path, fmt.ANALYSIS, prompt_id)
            fmt.ensure_group(folder)
        except OSError as exc:
            raise disk_error(exc, what) from exc
        write_sealed(folder, name, arrays, attrs, what)

    def read(self, prompt_id: str, name: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """(arrays, attrs) of a stored result, or None; CorruptError if it changed since it was written."""
        path = refuse_links(self.store.path, fmt.ANALYSIS, check_prompt_id(prompt_id),
                            check_name(name, "an analysis name"))
        return read_sealed(path, f"analysis {name} of prompt {prompt_id} in {self.store.path}",
                           sealed=self.store.format_version >= fmt.SEALED_SINCE)

    def names(self, prompt_id: str) -> list[str]:
        """Names of the results kept under ``analysis/<prompt_id>/`` (temporary folders of a write excluded)."""
        folder = refuse_links(self.store.path, fmt.ANALYSIS, check_prompt_id(prompt_id))
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if NAME.fullmatch(p.name) and (p / "zarr.json").is_file())
