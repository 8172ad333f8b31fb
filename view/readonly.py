"""A store opened for viewing: everything is read from the store, nothing is ever written to it.

The viewer runs the analyses of :mod:`detjac.analysis` (so what it shows equals what ``detjac analyze`` prints)
on a :class:`ReadOnlyStore`: a reader over the store whose analysis cache keeps their results in memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from ..store import AnalysisCache, MemoryAnalyses, StoredPrompt, StoreReader, VerifyResult

KEPT_PROMPTS = 64  # opened prompts kept (each holds its zarr group's handles, not its arrays)


class ReadOnlyStore(StoreReader):
    """``store`` as the analyses see it in the viewer (see the module docstring).

    ``stored`` is the store's own analysis cache (what ``detjac analyze`` kept, only read); :attr:`analyses`
    keeps what is computed here in memory over it. Model matrices and files are read (and checked) once and kept.
    """

    def __init__(self, store: StoreReader) -> None:
        self.inner = store
        self.path = store.path
        self.run = store.run
        self.format_version = store.format_version
        self.created = store.created
        self.stored = store.analyses
        self._analyses = MemoryAnalyses(self.stored)
        self._model: dict[str, np.ndarray] = {}
        self._files: dict[str, bytes | None] = {}
        self._prompts: OrderedDict[str, StoredPrompt] = OrderedDict()  # opened prompts, least recently used first
        self._lock = threading.Lock()

    @property
    def analyses(self) -> AnalysisCache:
        return self._analyses

    def prompt_ids(self) -> list[str]:
        return self.inner.prompt_ids()

    def get(self, prompt_id: str) -> StoredPrompt:
        """The prompt, opened (its files checked) once and kept: a committed prompt never changes, and every page of
        it (the prompt page, one per operator, its graph) asks for it."""
        with self._lock:
            if prompt_id in self._prompts:
                self._prompts.move_to_end(prompt_id)
                return self._prompts[prompt_id]
        prompt = self.inner.get(prompt_id)
        with self._lock:
            self._prompts[prompt_id] = prompt
            while len(self._prompts) > KEPT_PROMPTS:
                self._prompts.popitem(last=False)
        return prompt

    def prompt_attrs(self, prompt_id: str) -> dict[str, Any]:
        return self.inner.prompt_attrs(prompt_id)

    def verify(self, progress: bool = False) -> list[VerifyResult]:
        return self.inner.verify(progress)

    def model_array(self, name: str) -> np.ndarray:
        with self._lock:
            if name not in self._model:
                self._model[name] = self.inner.model_array(name)
            return self._model[name]

    def model_bytes(self, name: str) -> bytes | None:
        with self._lock:
            if name not in self._files:
                self._files[name] = self.inner.model_bytes(name)
            return self._files[name]

    def lens_names(self) -> list[str]:
        return self.inner.lens_names()

    def read_lens(self, name: str, arrays: bool = True) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        return self.inner.read_lens(name, arrays)

    def failures(self) -> dict[str, dict[str, Any]]:
        return self.inner.failures()

    def staging_leftovers(self) -> list[str]:
        return self.inner.staging_leftovers()

    def interrupted_writes(self) -> list[str]:
        return self.inner.interrupted_writes()
