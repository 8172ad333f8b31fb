"""The zarr backend's analysis cache: each result a sealed group ``analysis/<prompt_id>/<name>``, replaced whole."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from detjac.errors import StoreError

from .. import format as fmt
from ..analysis_cache import AnalysisCache
from ..integrity import NAME, CorruptError, check_name, check_prompt_id, content_digest, refuse_links
from .disk import disk_refusal
from .sealed import read_sealed, write_sealed

if TYPE_CHECKING:
    from ..reader import StoreReader

SOURCE = "source_sha256"  # attribute of a result: the content digest of the prompt it was computed from


class ZarrAnalyses(AnalysisCache):
    """The analysis results kept in the store folder of ``store`` (results of its complete prompts only)."""

    def __init__(self, store: StoreReader) -> None:
        self.store = store

    def write(self, prompt_id: str, name: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        """Store a result of a prompt under ``analysis/<prompt_id>/<name>`` (replaced atomically)."""
        check_name(name, "an analysis result name")
        # the prompt must exist with intact attributes (its arrays are checked where the result's caller read them)
        source = content_digest(self.store.prompt_attrs(prompt_id))
        if source is not None:
            attrs = {**attrs, SOURCE: source}
        what = f"write analysis {name} of prompt {prompt_id}"
        with disk_refusal(what):
            folder = refuse_links(self.store.path, fmt.ANALYSIS)
            fmt.ensure_group(folder)
            folder = refuse_links(self.store.path, fmt.ANALYSIS, prompt_id)
            fmt.ensure_group(folder)
        write_sealed(folder, name, arrays, attrs, what)

    def read(self, prompt_id: str, name: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """(arrays, attrs) of a stored result, or None; CorruptError if it changed since it was written.

        A result is None (computed again) unless it records the sealed content of the prompt as it is now: a
        result must not outlive the numbers it was computed from (a prompt replaced, or read while damaged by a
        detjac that did not check its metadata). Opening the prompt checks its metadata (raises CorruptError)."""
        found = self._read_own(prompt_id, name)
        if found is None or not self.sealed:
            return found
        arrays, attrs = found
        if attrs.pop(SOURCE, None) != content_digest(self.store.get(prompt_id).attrs):
            return None
        return arrays, attrs

    @property
    def sealed(self) -> bool:
        return self.store.format_version >= fmt.SEALED_SINCE

    def _read_own(self, prompt_id: str, name: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """The result as stored, its own seal checked (not yet against its prompt)."""
        path = refuse_links(self.store.path, fmt.ANALYSIS, check_prompt_id(prompt_id),
                            check_name(name, "an analysis name"))
        return read_sealed(path, f"analysis {name} of prompt {prompt_id} in {self.store.path}", sealed=self.sealed)

    def check(self, prompt_id: str, name: str) -> None:
        """What ``verify`` asks of a result: its own seal (raises CorruptError), and, where its prompt is intact
        (a damaged prompt is reported on its own), that it was computed from the prompt's content as it is now.
        """
        found = self._read_own(prompt_id, name)
        if found is None:
            raise CorruptError(f"analysis {name} of {prompt_id} vanished while verified")
        if not self.sealed:
            return
        try:
            current = content_digest(self.store.get(prompt_id).attrs)
        except StoreError:
            return
        if found[1].get(SOURCE) != current:
            raise CorruptError(f"analysis {name} of {prompt_id} was computed from other content than the prompt "
                               "holds now; `detjac analyze` computes it again")

    def names(self, prompt_id: str) -> list[str]:
        """Names of the results kept under ``analysis/<prompt_id>/`` (temporary folders of a write excluded)."""
        folder = refuse_links(self.store.path, fmt.ANALYSIS, check_prompt_id(prompt_id))
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if NAME.fullmatch(p.name) and (p / "zarr.json").is_file())
