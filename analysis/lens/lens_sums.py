"""The lens's running sums in a ``detjac run --lens`` process, flushed as sealed partials after each prompt is
committed, so that a kill loses at most the unflushed prompts and never counts one twice (``docs/lens.md``,
"Crash safety"). Torch-free.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from detjac.errors import StoreError

from .lens_fit import PARTIAL, write_partial

if TYPE_CHECKING:
    from detjac.store import StoreReader, StoreWriter


class RunningSums:
    """Running ``Σ T_p``, ``Σ T_p ⊙ T_p`` and the ids they cover, per lens layer, flushed as sealed partials.

    Parameters
    ----------
    layers : sequence of int
        The lens layers, in the order of the blocks given to :meth:`add`.
    flush_every : int
        Prompts added between two flushes (1: every prompt is counted on disk as soon as it is committed).
    """

    def __init__(self, layers: Sequence[int], flush_every: int = 1) -> None:
        self.layers = [int(layer) for layer in layers]
        self.flush_every = flush_every
        self.total: dict[int, np.ndarray] = {}
        self.square: dict[int, np.ndarray] = {}
        self.ids: dict[int, list[str]] = {layer: [] for layer in self.layers}
        self.counted: dict[int, set[str]] = {layer: set() for layer in self.layers}  # by partials on disk
        self.written: dict[int, str] = {}  # layer -> this process's latest partial
        self.store: StoreWriter | None = None
        self.unflushed = 0
        self._added: dict[int, set[str]] = {layer: set() for layer in self.layers}
        self._seen: set[str] = set()  # partial names already read
        self._lock = threading.Lock()  # a worker may run prompts on several threads

    def add(self, store: StoreWriter, pid: str, blocks: np.ndarray) -> None:
        """Count the committed prompt ``pid``: ``blocks`` (layer, d, d) are its ``T_p``, in ``layers`` order;
        a layer whose partials (or these sums) already count ``pid`` is left as it is."""
        with self._lock:
            self.store = store
            self._read_partials(store)
            for layer, T in zip(self.layers, blocks, strict=True):
                if pid in self.counted[layer] or pid in self._added[layer]:
                    continue
                T = np.asarray(T, dtype=np.float64)
                if layer in self.total:
                    self.total[layer] += T
                    self.square[layer] += T * T
                else:
                    self.total[layer], self.square[layer] = T.copy(), T * T
                self.ids[layer].append(pid)
                self._added[layer].add(pid)
            self.unflushed += 1
            if self.unflushed >= self.flush_every:
                self._flush()

    def flush(self) -> None:
        """Write the sums not yet on disk (nothing when every added prompt is already flushed)."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        if self.unflushed == 0 or self.store is None:
            return
        for layer in self.layers:
            ids = self.ids[layer]
            if not ids:
                continue
            name = write_partial(self.store, layer, ids, self.total[layer], self.square[layer])
            previous = self.written.get(layer)
            if previous is not None and previous != name:
                self.store.remove_lens(previous)  # a subset of the new partial
            self.written[layer] = name
            self._seen.add(name)
        self.unflushed = 0

    def _read_partials(self, store: StoreReader) -> None:
        """Add the ids of partials written since the last look (by earlier runs or other workers) to ``counted``."""
        for name in store.lens_names():
            if not name.startswith(f"{PARTIAL}-") or name in self._seen:
                continue
            self._seen.add(name)
            try:
                found = store.read_lens(name, arrays=False)
            except StoreError:  # damaged, or being replaced: the fit reads (and refuses) what is left
                found = None
            if found is None:  # replaced meanwhile by a wider one: read on the next look
                self._seen.discard(name)
                continue
            attrs = found[1]
            layer = attrs.get("layer")
            if layer in self.counted:
                self.counted[layer].update(attrs.get("prompt_ids") or [])
