"""The reading side of a Jacobian store: what the viewer, the analyses and ``detjac store`` use.

A store holds one run (a model with fixed settings) and many prompts; a reader sees each prompt complete or not
at all. Abstract members are what a backend implements; the concrete ones (:meth:`StoreReader.prompts`, ...) are
written once from them. ``tests/store/test_store_conformance.py`` checks every backend against it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np

from .analysis_cache import AnalysisCache
from .stored_prompt import StoredPrompt

__all__ = ["StoreReader", "VerifyResult"]


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


class StoreReader(ABC):
    """A run's prompts, readable while a writer adds more.

    Shapes use the store's dimension names: ``row`` (the target's components, ``d_model``), ``token`` (the
    prompt's tokens), ``col`` (the input's components), ``vocab``, ``rank``.

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
    """

    path: Path
    run: dict[str, Any]
    format_version: int
    created: str | None

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

    # -- derived results: analyses per prompt, the corpus-level lens ---------------------------

    @property
    @abstractmethod
    def analyses(self) -> AnalysisCache:
        """Where the analyses keep their results of this store's prompts (:mod:`detjac.store.analysis_cache`).

        Results are derived data, never the run's: a handle opened only for reading keeps them too."""

    def read_analysis(self, prompt_id: str, name: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """``self.analyses.read(prompt_id, name)``: a kept result ``(arrays, attrs)``, or None."""
        return self.analyses.read(prompt_id, name)

    def write_analysis(self, prompt_id: str, name: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        """``self.analyses.write(prompt_id, name, arrays, attrs)``: keep a result of a prompt."""
        self.analyses.write(prompt_id, name, arrays, attrs)

    def analysis_names(self, prompt_id: str) -> list[str]:
        """``self.analyses.names(prompt_id)``: the names of the results kept for a prompt, sorted."""
        return self.analyses.names(prompt_id)

    @abstractmethod
    def lens_names(self) -> list[str]:
        """Names of the corpus-level lens groups (``fitted``, a fit's partial sums: :mod:`detjac.analysis.lens`),
        sorted; empty when there are none."""

    @abstractmethod
    def read_lens(self, name: str, arrays: bool = True) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """``(arrays, attrs)`` of the lens group ``name`` (``arrays`` False: its attributes and an empty dict), or
        None when there is none.

        Raises
        ------
        StoreError
            The group changed since it was written (CorruptError).
        """

    # -- what runs left ------------------------------------------------------------------------

    @abstractmethod
    def failures(self) -> dict[str, dict[str, Any]]:
        """Failure records by prompt id (sorted): ``prompt``, ``line``, ``reason``, ``error``, ``stage``,
        ``failed_at``. A committed prompt has none."""

    @abstractmethod
    def staging_leftovers(self) -> list[str]:
        """Names of the attempts that began a prompt and have not committed or aborted it (sorted): running
        now, or killed; a run redoes those prompts."""

    def interrupted_writes(self) -> list[str]:
        """What writes killed midway left in the store (paths relative to it), never read as results; none for a
        store that writes nothing aside."""
        return []

    def close(self) -> None:  # noqa: B027 - a default, not a duty: reading handles hold nothing to release
        """Release what the store holds (a writer's lock); reading handles hold nothing."""

    def __enter__(self) -> Self:
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
