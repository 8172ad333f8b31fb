"""One prompt's side of the store interface: reading it (:class:`StoredPrompt`) and writing it (:class:`PromptWriter`).

Shapes use the store's dimension names: ``row``, ``token``, ``col``, ``vocab``, ``rank``;
``tests/store/test_store_conformance.py`` checks every backend against it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import StoreError
from .format import Keep
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
            reconstructs; for ``*_local`` targets, ``inputs`` (token, col), the layer's
            input hidden states, and for ``to_output`` targets ``input`` (token, col), the
            layer's output hidden states (what the Jacobian multiplies).
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

    def graph(self) -> dict[str, Any] | None:
        """The prompt's attribution graph as circuit-tracer's graph JSON object (schema_version 1: ``metadata``,
        ``qParams``, ``nodes``, ``links``), exactly as :func:`detjac.graphs.graph_dict` made it when the run computed
        it (``detjac run --graph``); None when the prompt was stored without one.

        Raises
        ------
        CorruptError
            A graph array is damaged (a chunk missing or failing its checksum) or the arrays do not form a graph.
        """
        return None

    def graph_arrays(self) -> dict[str, np.ndarray] | None:
        """The prompt's attribution graph as the store keeps it, its node and link tables (numpy arrays named in
        ``docs/store-format.md``, "The graph group": ``node_kind``, ``node_layer``, ``node_index``, ...,
        ``link_source``, ``link_target``, ``link_weight``), checked as :meth:`graph` checks them but never made
        into JSON objects: what a corpus of graphs is counted from. None when the prompt was stored without one.

        Raises
        ------
        CorruptError
            A graph array is damaged or the arrays do not form a graph.
        """
        return None

    def bias(self) -> np.ndarray | None:
        """(row,) offset ``b`` of an affine model's map ``y = sum_k J_k x_k + b``, or None (a linear model)."""
        try:
            return self.array("bias")
        except ValueError:
            return None

    @cached_property
    def keep(self) -> Keep:
        """What the prompt keeps of its Jacobian, read once from its attributes (:meth:`Keep.of_prompt`)."""
        return Keep.of_prompt(self.attrs)

    @property
    def low_rank(self) -> bool:
        """Whether the prompt was stored in low-rank mode (``--keep rank:K``): triplets, no Jacobian."""
        return self.keep.low_rank

    @property
    def without_jacobian(self) -> bool:
        """Whether the prompt keeps no Jacobian at all (``--keep none``: a ``detjac run --lens`` prompt, whose
        Jacobians went into the store's lens sums): its small arrays and attributes only."""
        return not self.keep.jacobian

    @property
    def prompt(self) -> str:
        """The prompt's text."""
        return self.attrs["prompt"]

    @property
    def n_tokens(self) -> int:
        return int(self.attrs["n_tokens"])

    def __repr__(self) -> str:
        a = self.attrs
        kind = (f"low-rank {self.keep}" if self.low_rank else "no Jacobian (lens run)"
                if self.without_jacobian else "full")
        layers = f", {len(self.layerwise_targets)} layerwise" if self.layerwise_targets else ""
        text = self.prompt if len(self.prompt) <= 40 else self.prompt[:37] + "..."
        error = a.get("reconstruction_error")
        return (f"<{type(self).__name__} {self.id}: {text!r}, {self.n_tokens} tokens, {kind}{layers}, "
                f"{a.get('storage_dtype', a.get('dtype'))}, next {a.get('next_token')!r}"
                + (f", error {error:.1e}>" if isinstance(error, float) else ">"))


@dataclass(frozen=True)
class LayerwiseSpec:
    """A layerwise Jacobian stored with a prompt: which target, and how the engine produces its blocks."""

    layer: int
    component: str  # a component of detjac.targets (layer, attn, mlp, resid_mid, layer_normed, ..., to_output)
    local: bool  # w.r.t. the layer's own input (True) or the input embeddings (False)
    mode: str = "reverse"  # reverse: row blocks; forward: token blocks
    token_block: int = 1


class PromptWriter(ABC):
    """Streams one prompt into a store; nothing is visible before :meth:`commit`.

    A writer is a context manager: leaving the ``with`` block on an exception aborts it.
    Every write method raises StoreError when its values do not fit the shapes given to
    :meth:`~detjac.store.writer.StoreWriter.begin` (the message says what was expected), and StoreError when
    the disk refuses the write, after aborting the prompt.
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

    def write_graph(self, data: dict[str, Any]) -> None:
        """The prompt's attribution graph, circuit-tracer's graph JSON object as :func:`detjac.graphs.graph_dict`
        makes it, kept as the ``graph`` group's node and link tables (``docs/store-format.md``).

        Raises
        ------
        StoreError
            The object is not such a graph, or this backend keeps no graphs.
        """
        raise StoreError(f"Expected a store backend that keeps attribution graphs. Got {type(self).__name__}, "
                         "which does not.")

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
