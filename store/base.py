"""What a Jacobian store backend provides; ``tests/store/test_store_conformance.py`` checks it.

A store holds one run (a model with fixed settings) and many prompts. A prompt is written
through a :class:`PromptWriter` and becomes visible only at :meth:`PromptWriter.commit`:
readers see a prompt complete or not at all.

Everything the other layers of detjac (runs, analyses, the CLI) call on a store, a stored
prompt or a writer is declared here, with the shapes it takes and returns; nothing they use
is specific to a backend. Abstract methods are what a backend implements; the concrete ones
(:meth:`StoredPrompt.bias`, :meth:`JacobianStore.prompts`, ...) are written once from them.
Shapes use the store's dimension names: ``row`` (the target's components, ``d_model``),
``token`` (the prompt's tokens), ``col`` (the input's components), ``vocab``, ``rank``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .prompt_base import LayerwiseSpec, PromptWriter, StoredPrompt

__all__ = ["JacobianStore", "LayerwiseSpec", "PromptWriter", "StoredPrompt", "VerifyResult"]


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of re-checking one prompt, or one other part of a store: ``ok`` or the reason it is corrupt.

    ``kind`` is ``prompt`` (``id`` is the prompt id) or, for the rest of the store, ``model`` (a decoding
    array or file), ``analysis`` (a stored result), ``failed`` (a failure record) or ``store`` (an entry
    that does not belong, a symlink); ``id`` is then its path inside the store.
    """

    id: str
    ok: bool
    reconstruction_error: float | None
    reason: str = ""
    kind: str = "prompt"


class JacobianStore(ABC):
    """A run's prompts, readable while a writer adds more.

    Attributes
    ----------
    path : pathlib.Path
        Where the store lives (a folder for the directory backend).
    run : dict
        The run description written at creation: its identity (``model_id``, ``dtype``,
        ``keep``, ``detach``, ...) and settings (see ``docs/store-format.md``).
    format_version : int
        The store format's version.
    created : str or None
        UTC ISO-8601 time of creation.
    restored, restored_earlier : Path or None
        Set on a handle opened for writing with ``force_new``: the store it replaced was put back (no prompt
        was stored) when the handle closed; a killed ``force_new`` run's replaced store was put back when
        this handle opened (where it had been kept aside).
    """

    path: Path
    run: dict[str, Any]
    format_version: int
    created: str | None
    restored: Path | None = None
    restored_earlier: Path | None = None

    # -- prompts ------------------------------------------------------------------------------

    @abstractmethod
    def prompt_ids(self) -> list[str]:
        """Ids of the complete prompts, sorted."""

    @abstractmethod
    def get(self, prompt_id: str) -> StoredPrompt:
        """A complete prompt.

        Raises
        ------
        StoreError
            No complete prompt has this id; the message names it (and the failure's reason when
            the prompt failed).
        """

    @abstractmethod
    def begin(self, prompt_id: str, *, n_rows: int, n_tokens: int, n_cols: int, dtype: str,
              row_block: int, rank: int | None = None,
              layerwise: dict[str, LayerwiseSpec] | None = None, shard_bytes: int | None = None,
              jacobian: bool = True) -> PromptWriter:
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

        Raises
        ------
        StoreError
            The store is not open for writing, or the arguments are inconsistent.
        """

    @abstractmethod
    def verify(self, progress: bool = False) -> list[VerifyResult]:
        """Re-read everything a reader uses, each prompt on its own.

        For every complete prompt: its attributes against the checksum written at commit, every
        file against its SHA-256, every chunk decoded (crc32c), the token ids against the
        attributes, and ``sum_k J_k x_k (+ b)`` against ``output`` within the bound of the run's
        dtype (:data:`detjac.exactness.DTYPE_BOUND`), layerwise targets included (low-rank
        prompts: their spectra). Then the rest of the store: the model arrays and files against
        their SHA-256s, stored analysis results, failure records, and any entry that does not
        belong (symlinks included). Stores of format 1 carry no checksums for attributes and
        files; for them only chunk checksums, types and reconstructions are checked.

        Parameters
        ----------
        progress : bool
            Show a progress bar.

        Returns
        -------
        list of VerifyResult
            One per prompt in id order, then one per other part checked (``kind`` says which).
            A damaged part is reported, never raised.
        """

    def prompt_attrs(self, prompt_id: str) -> dict[str, Any]:
        """A complete prompt's attributes (:attr:`StoredPrompt.attrs`), which a backend may read faster than
        :meth:`get` opens the prompt (a corpus of thousands is listed from them). The attributes are checked
        as :meth:`get` checks them; the prompt's arrays need not be.

        Raises
        ------
        StoreError
            As :meth:`get`.
        """
        return dict(self.get(prompt_id).attrs)

    # -- model matrices, kept for decoding without the model -----------------------------------

    @abstractmethod
    def model_array(self, name: str) -> np.ndarray:
        """A model matrix stored at creation.

        Parameters
        ----------
        name : str
            ``embedding`` (vocab, col), ``unembedding`` (vocab, row) or ``final_norm`` (row,): the
            final norm's gain.

        Raises
        ------
        StoreError
            The store has no such array (it was written without the model's matrices, or the
            family has no final norm gain).
        """

    @abstractmethod
    def model_bytes(self, name: str) -> bytes | None:
        """A file kept with the model arrays (``tokenizer.json``), or None when the store has none.

        Raises
        ------
        StoreError
            The bytes differ from the SHA-256 recorded at creation (CorruptError).
        """

    # -- analysis results -----------------------------------------------------------------------

    @abstractmethod
    def write_analysis(self, prompt_id: str, name: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        """Keep an analysis result of a prompt (replacing, atomically, one of the same ``name``).

        Parameters
        ----------
        prompt_id : str
            A complete prompt.
        name : str
            The result's name, e.g. ``svd_combined``, ``layers_layer.2``.
        arrays : dict of str to numpy.ndarray
            The result's arrays, any shapes.
        attrs : dict
            JSON-serializable parameters; ``written_at`` is added.

        Raises
        ------
        StoreError
            No complete prompt ``prompt_id``, or the disk refuses the write.
        """

    @abstractmethod
    def read_analysis(self, prompt_id: str, name: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """``(arrays, attrs)`` of a result kept by :meth:`write_analysis`, or None when there is none."""

    @abstractmethod
    def analysis_names(self, prompt_id: str) -> list[str]:
        """Names of the results kept for ``prompt_id`` by :meth:`write_analysis`, sorted; empty when there are none."""

    # -- the run writing the store ------------------------------------------------------------

    @property
    @abstractmethod
    def lease(self) -> str | None:
        """The writer lease under which a run's workers may write into this store (see
        :func:`detjac.store.attach_store`); None when the store is not open for writing."""

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
    def failures(self) -> dict[str, dict[str, Any]]:
        """Failure records by prompt id (sorted): ``prompt``, ``line``, ``reason``, ``error``, ``stage``,
        ``failed_at``. A committed prompt has none."""

    def interrupted_writes(self) -> list[str]:
        """What writes killed midway left in the store (paths relative to it), never read as results; none for a
        store that writes nothing aside."""
        return []

    @abstractmethod
    def staging_leftovers(self) -> list[str]:
        """Names of the attempts that began a prompt and have not committed or aborted it (sorted): running
        now, or killed; a run redoes those prompts."""

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

    def close(self) -> None:  # noqa: B027 - a default, not a duty: reading handles hold nothing to release
        """Release what the store holds (a writer's lock); reading handles hold nothing."""

    def __enter__(self) -> JacobianStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- composites -----------------------------------------------------------------------------

    def __repr__(self) -> str:
        r = self.run
        layers = f", {len(r['layerwise'])} layerwise targets" if r.get("layerwise") else ""
        return (f"<{type(self).__name__} {self.path}: {len(self)} prompts, model {r.get('model_id')} "
                f"({r.get('model_type')}), {r.get('dtype')}, {r.get('keep', 'full')}"
                f"{'' if r.get('detach', True) else ', ordinary'}{layers}>")

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in set(self.prompt_ids())

    def __len__(self) -> int:
        return len(self.prompt_ids())

    def __iter__(self) -> Iterator[StoredPrompt]:
        return (self.get(pid) for pid in self.prompt_ids())

    def prompts(self, contains: str | None = None,
                where: Callable[[dict[str, Any]], bool] | None = None) -> list[StoredPrompt]:
        """Complete prompts whose text contains ``contains`` and whose attrs satisfy ``where``."""
        found = []
        for prompt in self:
            if contains is not None and contains not in prompt.prompt:
                continue
            if where is not None and not where(prompt.attrs):
                continue
            found.append(prompt)
        return found
