"""What a Jacobian store backend provides; ``tests/test_store_conformance.py`` checks it.

A store holds one run (a model with fixed settings) and many prompts. A prompt is written
through a :class:`PromptWriter` and becomes visible only at :meth:`PromptWriter.commit`:
readers see a prompt complete or not at all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np


class StoredPrompt(ABC):
    """One complete prompt in a store (read-only)."""

    id: str
    attrs: dict[str, Any]

    @abstractmethod
    def jacobian(self, lazy: bool = True) -> Any:
        """(row, token, col): a dask array (``lazy=True``) or a numpy array."""

    @abstractmethod
    def operator(self, k: int) -> np.ndarray:
        """(row, col) operator ``J_k`` of token ``k`` (negative ``k`` counts from the end)."""

    @abstractmethod
    def array(self, name: str) -> np.ndarray:
        """Any array but the Jacobian, in full: ``embeddings`` (token, col), ``output`` (row), ``token_ids``
        (token), ``bias`` (row; affine models only), and in low-rank mode ``token_U``, ``token_S``, ...
        (see store/README.md)."""

    def bias(self) -> np.ndarray | None:
        """(row,) offset ``b`` of an affine model's map ``y = sum_k J_k x_k + b``, or None (a linear model)."""
        try:
            return self.array("bias")
        except ValueError:
            return None

    @property
    def prompt(self) -> str:
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
    """Streams one prompt into a store; nothing is visible before :meth:`commit`."""

    @abstractmethod
    def write_rows(self, start: int, stop: int, values: np.ndarray) -> None:
        """Jacobian rows ``start:stop``, (rows, token, col); rows arrive in order."""

    @abstractmethod
    def write_array(self, name: str, values: np.ndarray) -> None:
        """``embeddings``, ``output`` or ``token_ids`` in full, or an affine model's ``bias`` (row,)."""

    @abstractmethod
    def commit(self, attrs: dict[str, Any]) -> None:
        """Attach ``attrs`` and make the prompt visible, atomically."""

    @abstractmethod
    def abort(self) -> None:
        """Drop everything written so far."""

    def write_block(self, target: str, start: int, stop: int, token_start: int, token_stop: int,
                    values: np.ndarray) -> None:
        """Rows ``start:stop`` x tokens ``token_start:token_stop`` of ``"jacobian"`` or a layerwise target."""
        raise NotImplementedError(f"{type(self).__name__} does not store blocks")

    def write_layerwise(self, target: str, array: str, values: np.ndarray) -> None:
        """A layerwise target's ``output`` (row,) or, per-layer targets only, ``inputs`` (token, col)."""
        raise NotImplementedError(f"{type(self).__name__} does not store layerwise Jacobians")

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
    """A run's prompts, readable while a writer adds more."""

    path: Any
    run: dict[str, Any]
    format_version: int

    @abstractmethod
    def prompt_ids(self) -> list[str]:
        """Ids of the complete prompts, sorted."""

    @abstractmethod
    def get(self, prompt_id: str) -> StoredPrompt:
        """A complete prompt; raises StoreError naming the id if there is none."""

    @abstractmethod
    def begin(self, prompt_id: str, *, n_rows: int, n_tokens: int, n_cols: int, dtype: str,
              row_block: int, rank: int | None = None,
              layerwise: dict[str, LayerwiseSpec] | None = None, shard_bytes: int | None = None) -> PromptWriter:
        """Start writing a prompt (needs the store opened for writing); ``rank`` selects low-rank mode,
        ``layerwise`` names the layerwise Jacobians stored with it. ``shard_bytes`` caps what the writer
        holds before it writes (a backend's default when None); ``1`` writes every row block as it comes."""

    @abstractmethod
    def verify(self, progress: bool = False) -> list[VerifyResult]:
        """Re-read every complete prompt: checksums and ``sum_k J_k x_k`` against ``output``."""

    def failures(self) -> dict[str, dict[str, Any]]:
        """Failure records of prompts a run could not compute, by prompt id (a backend without them: none)."""
        return {}

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
