"""Where the analyses keep their results: per prompt and name, a few arrays and their parameters.

A store's own cache (:attr:`~detjac.store.reader.StoreReader.analyses`) keeps them in the store beside the
Jacobians (``detjac analyze``); :class:`MemoryAnalyses` keeps them in memory over another cache, which it only
reads (``detjac view`` never writes to the store it shows).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

__all__ = ["AnalysisCache", "MemoryAnalyses"]

Result = tuple[dict[str, np.ndarray], dict[str, Any]]  # (arrays, attrs)


class AnalysisCache(ABC):
    """Analysis results of a store's prompts, by prompt id and result name (``svd_combined``, ``layers_layer.2``,
    ...: :func:`detjac.analysis.jobs.result_name`)."""

    @abstractmethod
    def read(self, prompt_id: str, name: str) -> Result | None:
        """``(arrays, attrs)`` of a result kept by :meth:`write`, or None when there is none.

        Raises
        ------
        StoreError
            The result changed since it was written (CorruptError), or a name that is not one.
        """

    @abstractmethod
    def write(self, prompt_id: str, name: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        """Keep a result of a prompt, replacing (atomically) one of the same ``name``.

        Parameters
        ----------
        prompt_id : str
            A complete prompt.
        name : str
            The result's name, e.g. ``svd_combined``, ``layers_layer.2``.
        arrays : dict of str to numpy.ndarray
            The result's arrays, any shapes.
        attrs : dict
            JSON-serializable parameters; a store adds ``written_at``.

        Raises
        ------
        StoreError
            No complete prompt ``prompt_id``, or the disk refuses the write.
        """

    @abstractmethod
    def names(self, prompt_id: str) -> list[str]:
        """Names of the results kept for ``prompt_id``, sorted; empty when there are none."""


class MemoryAnalyses(AnalysisCache):
    """Results written here stay in memory; reads fall back to ``under`` (a store's own cache), never written.

    Parameters
    ----------
    under : AnalysisCache
        What is read when this cache holds no result of that name: what ``detjac analyze`` kept in the store.
    """

    def __init__(self, under: AnalysisCache) -> None:
        self.under = under
        self._kept: dict[tuple[str, str], Result] = {}

    def read(self, prompt_id: str, name: str) -> Result | None:
        kept = self._kept.get((prompt_id, name))
        return kept if kept is not None else self.under.read(prompt_id, name)

    def write(self, prompt_id: str, name: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        """Keep the result in memory; ``under`` is not touched."""
        self._kept[(prompt_id, name)] = (dict(arrays), dict(attrs))

    def names(self, prompt_id: str) -> list[str]:
        return sorted({*self.under.names(prompt_id), *(name for pid, name in self._kept if pid == prompt_id)})
