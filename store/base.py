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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .subspace import Triplets


class StoredPrompt(ABC):
    """One complete prompt in a store (read-only).

    Attributes
    ----------
    id : str
        The prompt id (16 hex digits for prompts written by ``detjac run``).
    attrs : dict
        The attributes committed with the prompt (``prompt``, ``n_tokens``,
        ``reconstruction_error``, ``next_token_id``, ...; see ``docs/store-format.md``).
    """

    id: str
    attrs: dict[str, Any]

    @abstractmethod
    def jacobian(self, lazy: bool = True) -> Any:
        """The prompt's Jacobian ``[J_1 ... J_n]``.

        Parameters
        ----------
        lazy : bool
            A dask array chunked like the store (True) or a numpy array read in full (False).

        Returns
        -------
        dask.array.Array or numpy.ndarray
            (row, token, col).

        Raises
        ------
        StoreError
            The prompt was stored in low-rank mode and has no full Jacobian (see :meth:`triplets`).
        """

    @abstractmethod
    def operator(self, k: int) -> np.ndarray:
        """Token ``k``'s operator ``J_k``, (row, col); a negative ``k`` counts from the end.

        Raises
        ------
        InvalidArgumentError
            ``k`` outside ``[-n_tokens, n_tokens)``.
        StoreError
            A low-rank prompt (no full Jacobian).
        """

    @abstractmethod
    def array(self, name: str) -> np.ndarray:
        """Any array of the prompt but its Jacobian, in full.

        Parameters
        ----------
        name : str
            ``embeddings`` (token, col), ``output`` (row,), ``token_ids`` (token,), ``bias`` (row,;
            affine models only), and in low-rank mode ``token_U`` (token, row, rank), ``token_S``
            (token, rank), ``token_V`` (token, col, rank), ``token_frobenius_sq`` (token,), ...
            (see ``docs/store-format.md``).

        Raises
        ------
        InvalidArgumentError
            ``name`` is not an array of this prompt; the message lists those it has.
        """

    @abstractmethod
    def triplets(self, k: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Low-rank mode: the stored top singular triplets ``(U, S, V)``.

        Parameters
        ----------
        k : int or None
            Token ``k``'s ``J_k`` (negative counts from the end), or None for the combined
            operator ``[J_1 ... J_n]``.

        Returns
        -------
        tuple of numpy.ndarray
            ``U`` (row, rank), ``S`` (rank,) descending, and ``V``: (col, rank) for a token,
            (token, col, rank) for the combined operator.

        Raises
        ------
        StoreError
            The prompt holds its full Jacobian, not triplets.
        InvalidArgumentError
            ``k`` outside ``[-n_tokens, n_tokens)``.
        """

    @property
    @abstractmethod
    def layerwise_targets(self) -> list[str]:
        """Names of the layerwise Jacobians stored with the prompt (``layer.3``, ``mlp_local.0``, ...),
        in :class:`detjac.targets.Target` order (by layer, then component); empty when none."""

    @abstractmethod
    def layerwise(self, target: str, array: str = "jacobian", lazy: bool = True) -> Any:
        """One array of a layerwise target.

        Parameters
        ----------
        target : str
            One of :attr:`layerwise_targets`.
        array : str
            ``jacobian`` (row, token, col); ``output`` (row,), the value the Jacobian
            reconstructs; or, for ``*_local`` targets, ``inputs`` (token, col), the layer's
            input hidden states (what the Jacobian multiplies).
        lazy : bool
            For ``jacobian``: a dask array (True) or numpy (False). The others are numpy.

        Raises
        ------
        InvalidArgumentError
            ``target`` is not stored with the prompt, or ``array`` is not one of its arrays;
            the message lists what there is.
        """

    @abstractmethod
    def layerwise_info(self, target: str) -> dict[str, Any]:
        """What a layerwise target is and how well it reconstructs.

        Returns
        -------
        dict
            ``layer`` (int), ``component`` (``layer``, ``attn`` or ``mlp``), ``local`` (bool: with
            respect to the layer's own input), ``mode`` (``reverse`` or ``forward``) and, when the
            run recorded it, ``reconstruction_error``.

        Raises
        ------
        InvalidArgumentError
            ``target`` is not stored with the prompt.
        """

    def bias(self) -> np.ndarray | None:
        """(row,) offset ``b`` of an affine model's map ``y = sum_k J_k x_k + b``, or None (a linear model)."""
        try:
            return self.array("bias")
        except ValueError:
            return None

    @property
    def low_rank(self) -> bool:
        """Whether the prompt was stored in low-rank mode (``--keep rank:K``): triplets, no Jacobian."""
        return "rank" in self.attrs

    @property
    def prompt(self) -> str:
        """The prompt's text."""
        return self.attrs["prompt"]

    @property
    def n_tokens(self) -> int:
        return int(self.attrs["n_tokens"])


@dataclass(frozen=True)
class LayerwiseSpec:
    """A layerwise Jacobian stored with a prompt: which target, and how the engine produces its blocks."""

    layer: int
    component: str  # layer, attn or mlp
    local: bool  # w.r.t. the layer's own input (True) or the input embeddings (False)
    mode: str = "reverse"  # reverse: row blocks; forward: token blocks
    token_block: int = 1


class PromptWriter(ABC):
    """Streams one prompt into a store; nothing is visible before :meth:`commit`.

    A writer is a context manager: leaving the ``with`` block on an exception aborts it.
    Every write method raises StoreError when its values do not fit the shapes given to
    :meth:`JacobianStore.begin` (the message says what was expected), and StoreError when the
    disk refuses the write, after aborting the prompt.
    """

    @abstractmethod
    def write_rows(self, start: int, stop: int, values: np.ndarray) -> None:
        """Jacobian rows ``start:stop``, (rows, token, col), all tokens; rows arrive in order (full mode)."""

    @abstractmethod
    def write_block(self, target: str, start: int, stop: int, token_start: int, token_stop: int,
                    values: np.ndarray) -> None:
        """Rows ``start:stop`` x tokens ``token_start:token_stop`` of a Jacobian, (rows, tokens, col).

        Parameters
        ----------
        target : str
            ``"jacobian"`` (the prompt's Jacobian) or a layerwise target named in ``begin``.
        start, stop, token_start, token_stop : int
            The block. Blocks may come in any order and must not overlap; a Jacobian counts as
            written when its blocks cover it.
        values : numpy.ndarray
            (stop - start, token_stop - token_start, col).
        """

    @abstractmethod
    def write_array(self, name: str, values: np.ndarray) -> None:
        """``embeddings`` (token, col), ``output`` (row,) or ``token_ids`` (token,) in full, or an affine
        model's ``bias`` (row,).

        Raises
        ------
        InvalidArgumentError
            Another ``name``.
        """

    @abstractmethod
    def write_layerwise(self, target: str, array: str, values: np.ndarray) -> None:
        """A layerwise target's ``output`` (row,) -- the value its Jacobian reconstructs -- or, for a
        ``*_local`` target, its ``inputs`` (token, col): the layer's input hidden states."""

    @abstractmethod
    def write_triplets(self, per_token: Sequence[Triplets], combined: Triplets) -> dict[str, Any]:
        """Low-rank mode: every token's and the combined operator's triplets (see :mod:`detjac.store.subspace`).

        Parameters
        ----------
        per_token : sequence of Triplets
            One per token: ``U`` (row, rank), ``S`` (rank,), ``V`` (col, rank) and the energies.
        combined : Triplets
            Of ``[J_1 ... J_n]``: ``V`` (token * col, rank).

        Returns
        -------
        dict
            Attributes to pass to :meth:`commit`: ``keep``, ``rank``, ``combined_frobenius_sq``,
            ``combined_residual_sq``, ``combined_captured``.

        Raises
        ------
        StoreError
            The prompt was begun in full mode.
        """

    @abstractmethod
    def commit(self, attrs: dict[str, Any]) -> None:
        """Attach ``attrs`` and make the prompt visible, atomically.

        If the same prompt was committed meanwhile (another attempt at it), the first one is
        kept and this one dropped.

        Raises
        ------
        StoreError
            An array of the prompt is missing (the writer is aborted), the store is no longer
            held by this writer's run, or the disk refuses the commit.
        """

    @abstractmethod
    def abort(self) -> None:
        """Drop everything written so far."""

    def __enter__(self) -> PromptWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of re-checking one prompt: ``ok`` or the reason it is corrupt."""

    id: str
    ok: bool
    reconstruction_error: float | None
    reason: str = ""


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

    @abstractmethod
    def begin(self, prompt_id: str, *, n_rows: int, n_tokens: int, n_cols: int, dtype: str,
              row_block: int, rank: int | None = None,
              layerwise: dict[str, LayerwiseSpec] | None = None, shard_bytes: int | None = None) -> PromptWriter:
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

        Raises
        ------
        StoreError
            The store is not open for writing, or the arguments are inconsistent.
        """

    @abstractmethod
    def verify(self, progress: bool = False) -> list[VerifyResult]:
        """Re-read every complete prompt: checksums, and ``sum_k J_k x_k (+ b)`` against ``output`` within the
        bound of the prompt's dtype (:data:`detjac.exactness.DTYPE_BOUND`), layerwise targets included.

        Parameters
        ----------
        progress : bool
            Show a progress bar.

        Returns
        -------
        list of VerifyResult
            One per prompt, in id order.
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
    def model_file(self, name: str) -> Path | None:
        """A local path of a file kept with the model arrays (e.g. ``tokenizer.json``), or None."""

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

    def close(self) -> None:
        """Release what the store holds (a writer's lock); reading handles hold nothing."""

    def __enter__(self) -> JacobianStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- composites -----------------------------------------------------------------------------

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
