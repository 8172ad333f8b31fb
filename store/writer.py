"""The writing side of a Jacobian store: prompts begun and committed, failure records, the run's lease and staging.

:class:`StoreWriter` extends :class:`~detjac.store.reader.StoreReader`. A prompt is written through a
:class:`~detjac.store.stored_prompt.PromptWriter` and becomes visible only at its commit. ``JacobianStore``
is the earlier name of this interface, kept for the code that imports it.
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np

from .reader import StoreReader
from .stored_prompt import LayerwiseSpec, PromptWriter

__all__ = ["JacobianStore", "StoreWriter"]


class StoreWriter(StoreReader):
    """A handle a run writes a store through (one opened only for reading refuses :meth:`begin`,
    :meth:`record_failure` and :meth:`clear_staging`).

    Attributes
    ----------
    restored, restored_earlier : Path or None
        Set on a handle opened for writing with ``force_new``: the store it replaced was put back (no prompt
        was stored) when the handle closed; a killed ``force_new`` run's replaced store was put back when
        this handle opened (where it had been kept aside).
    """

    restored: Path | None = None
    restored_earlier: Path | None = None

    # -- prompts ------------------------------------------------------------------------------

    @abstractmethod
    def begin(self, prompt_id: str, *, n_rows: int, n_tokens: int, n_cols: int, dtype: str,
              row_block: int, rank: int | None = None,
              layerwise: dict[str, LayerwiseSpec] | None = None, shard_bytes: int | None = None,
              jacobian: bool = True, graph: bool = False) -> PromptWriter:
        """Start writing a prompt.

        Parameters
        ----------
        prompt_id : str
            The id it will be stored under.
        n_rows, n_tokens, n_cols : int
            The Jacobian's shape (row, token, col).
        dtype : str
            numpy dtype of what is stored (``float64``, ``float32``).
        row_block : int
            Rows per block as the engine produces them (the Jacobian's chunking).
        rank : int or None
            Low-rank mode (``--keep rank:K``): only triplets of this rank are stored.
        layerwise : dict of str to LayerwiseSpec, optional
            The layerwise Jacobians stored with the prompt, by target name (full mode only).
        shard_bytes : int or None
            Caps what the writer holds before it writes (a backend's default when None); ``1``
            writes every row block as it comes.
        jacobian : bool
            False: the prompt keeps no Jacobian, only its small arrays and attributes (``--keep none``, a
            ``detjac run --lens`` run, whose Jacobians go into the store's lens sums instead).
        graph : bool
            True: the prompt is complete only with its attribution graph (:meth:`PromptWriter.write_graph`,
            ``detjac run --graph``); commit refuses it without.

        Raises
        ------
        StoreError
            The store is not open for writing, or the arguments are inconsistent.
        """

    # -- the run writing the store ------------------------------------------------------------

    @property
    @abstractmethod
    def lease(self) -> str | None:
        """The writer lease under which a run's workers may write into this store (see
        :func:`detjac.store.attach_store`); None when the store is not open for writing."""

    @property
    @abstractmethod
    def writable(self) -> bool:
        """Whether this handle holds the store for writing (its writer lock, or a worker's lease)."""

    @abstractmethod
    def writing(self) -> AbstractContextManager[StoreWriter]:
        """Hold the store for writing for a ``with`` block (a handle that already holds it keeps it), so that no
        run or other fit writes it meanwhile.

        Raises
        ------
        StoreError
            Another process writes the store; the message names it.
        """

    @abstractmethod
    def record_failure(self, prompt_id: str, attrs: dict[str, Any]) -> None:
        """Record that ``prompt_id`` could not be computed (replacing an earlier record).

        Parameters
        ----------
        attrs : dict
            ``prompt``, ``line``, ``meta``, ``reason``, ``error``, ``stage`` (see ``docs/store-format.md``);
            ``failed_at`` is added.

        Raises
        ------
        StoreError
            The store is not open for writing by the run that holds it, or the disk refuses.
        """

    @abstractmethod
    def clear_staging(self) -> None:
        """Drop every attempt that has not committed (call when none of this run's attempts is running).

        Raises
        ------
        StoreError
            The store is not open for writing.
        """

    @abstractmethod
    def discard(self) -> None:
        """Delete the store if this handle created it and it holds no prompt and no failure record (a run that
        was refused before its first prompt leaves nothing behind); otherwise do nothing."""

    # -- the corpus-level lens ------------------------------------------------------------------

    @abstractmethod
    def write_lens(self, name: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any],
                   dims: dict[str, tuple[str, ...]] | None = None) -> None:
        """Keep the lens group ``name`` (replacing, atomically, one of the same name); ``dims`` names the arrays'
        dimensions. Its writers hold the store (:meth:`writing`) or write under its run's lease."""

    @abstractmethod
    def remove_lens(self, name: str) -> None:
        """Remove the lens group ``name`` (nothing if there is none)."""


JacobianStore = StoreWriter
