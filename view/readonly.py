"""A store opened for viewing: everything is read from the store, nothing is ever written to it.

The analyses of :mod:`detjac.analysis` keep their results in the store they are given
(``write_analysis``) and reuse them (``read_analysis``). The viewer runs the very same
functions, so what it shows equals what ``detjac analyze`` prints, but it must not change the
store it shows: :class:`ReadOnlyStore` wraps an opened store, reads everything through it,
keeps the results the analyses would write in memory instead, and refuses every other write.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..errors import StoreError
from ..store.base import JacobianStore, LayerwiseSpec, PromptWriter, StoredPrompt, VerifyResult


class ReadOnlyStore(JacobianStore):
    """``store`` as the analyses see it, with their results kept in memory (see the module docstring).

    :meth:`stored_analysis` tells a result kept in the store (by ``detjac analyze``) from one
    computed here; model matrices and files are read (and checked) once and kept.
    """

    def __init__(self, store: JacobianStore) -> None:
        self.inner = store
        self.path = store.path
        self.run = store.run
        self.format_version = store.format_version
        self.created = store.created
        self._memory: dict[tuple[str, str], tuple[dict[str, np.ndarray], dict[str, Any]]] = {}
        self._model: dict[str, np.ndarray] = {}
        self._files: dict[str, bytes | None] = {}
        self._lock = threading.Lock()

    def prompt_ids(self) -> list[str]:
        return self.inner.prompt_ids()

    def get(self, prompt_id: str) -> StoredPrompt:
        return self.inner.get(prompt_id)

    def prompt_attrs(self, prompt_id: str) -> dict[str, Any]:
        return self.inner.prompt_attrs(prompt_id)

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

    def read_analysis(self, prompt_id: str, name: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        kept = self._memory.get((prompt_id, name))
        return kept if kept is not None else self.inner.read_analysis(prompt_id, name)

    def stored_analysis(self, prompt_id: str, name: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """A result kept in the store itself (not one computed by this viewer), or None."""
        return self.inner.read_analysis(prompt_id, name)

    def analysis_names(self, prompt_id: str) -> list[str]:
        return self.inner.analysis_names(prompt_id)

    def write_analysis(self, prompt_id: str, name: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        """Keep the result in memory; the store is not touched."""
        self._memory[(prompt_id, name)] = (dict(arrays), dict(attrs))

    def failures(self) -> dict[str, dict[str, Any]]:
        return self.inner.failures()

    def staging_leftovers(self) -> list[str]:
        return self.inner.staging_leftovers()

    def verify(self, progress: bool = False) -> list[VerifyResult]:
        return self.inner.verify(progress)

    @property
    def lease(self) -> str | None:
        return None

    def _refuse(self, what: str) -> StoreError:
        return StoreError(f"Expected no writes to {self.path}: it is open for viewing only. Got a request to {what}.")

    def begin(self, prompt_id: str, *, n_rows: int, n_tokens: int, n_cols: int, dtype: str, row_block: int,
              rank: int | None = None, layerwise: dict[str, LayerwiseSpec] | None = None,
              shard_bytes: int | None = None) -> PromptWriter:
        raise self._refuse(f"write prompt {prompt_id}")

    def record_failure(self, prompt_id: str, attrs: dict[str, Any]) -> None:
        raise self._refuse(f"record a failure of prompt {prompt_id}")

    def clear_staging(self) -> None:
        raise self._refuse("clear its staging folder")

    def discard(self) -> None:
        """Nothing to do: a store opened for viewing was not created by this handle."""
