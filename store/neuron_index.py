"""A neuron index on disk (``detjac neurons``): a folder holding one sealed zarr group, ``index``, replaced whole
and atomically at every commit (:func:`detjac.store.write_sealed`), so a killed run leaves the last commit intact
and resumes from the shards it lists. The root group's attributes name the model and the settings (its identity);
an index asked for by another model or other settings is refused, naming what differs. Layout and rules:
docs/store-format.md, "Neuron indexes"."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, StoreError
from ..safe_json import read_json
from .backend.sealed import read_sealed, write_sealed
from .neuron_stats import EDGES, NeuronStats

KIND = "detjac-neuron-index"
FORMAT = 1
GROUP = "index"
DIMS = {"top_value": ("layer", "neuron", "sign", "rank"), "top_prompt": ("layer", "neuron", "sign", "rank"),
        "top_position": ("layer", "neuron", "sign", "rank"), "histogram": ("layer", "neuron", "bin"),
        "n_positive": ("layer", "neuron"), "n_negative": ("layer", "neuron"), "sum": ("layer", "neuron"),
        "sum_squares": ("layer", "neuron"), "edges": ("edge",), "prompt_tokens": ("corpus_token",),
        "prompt_offsets": ("prompt_edge",), "prompt_line": ("prompt",), "vocab_ids": ("vocab",),
        "vocab_utf8": ("vocab_byte",), "vocab_offsets": ("vocab_edge",),
        "write_ids": ("layer", "neuron", "sign", "write_rank"),
        "write_values": ("layer", "neuron", "sign", "write_rank")}


class NeuronIndexMismatch(StoreError, ValueError):
    """A neuron index made with another model or other settings than the ones asking for it."""


def identity_differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """``name: stored (index) != wanted`` for every key of ``wanted`` that the index records otherwise."""
    return [f"{key}: {stored.get(key)!r} (index) != {value!r}" for key, value in sorted(wanted.items())
            if stored.get(key) != value]


def check_identity(path: Path, stored: dict[str, Any], wanted: dict[str, Any]) -> None:
    """Raise :class:`NeuronIndexMismatch` naming the differences between ``stored`` and ``wanted``."""
    diffs = identity_differences(stored, wanted)
    if diffs:
        raise NeuronIndexMismatch(f"Expected a neuron index made with this model and these settings. Got {path}, "
                                  f"made otherwise: {'; '.join(diffs)}.")


def start_index(path: str | Path, identity: dict[str, Any], force_new: bool = False) -> list[int]:
    """Create the index folder at ``path`` for ``identity`` (the model's weights digest and the settings), or find
    the one a killed run left; returns the shards its last commit counts (empty for a new index).

    Raises
    ------
    NeuronIndexMismatch
        An index at ``path`` made with another identity (``force_new`` replaces it).
    StoreError
        Something at ``path`` that is not a neuron index.
    """
    import shutil

    import zarr

    path = Path(path)
    if (path / "zarr.json").is_file():
        attrs = read_json(path / "zarr.json").get("attributes", {})
        if attrs.get("kind") != KIND:
            raise StoreError(f"Expected a neuron index (or nothing) at {path}. Got another zarr group; choose "
                             "another --out.")
        if not force_new:
            check_identity(path, attrs.get("identity", {}), identity)
            found = read_sealed(path / GROUP, f"neuron index {path}", arrays=False)
            return [] if found is None else list(found[1]["shards"])
        shutil.rmtree(path)
    elif path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise StoreError(f"Expected an empty folder or nothing at {path} for a neuron index. Got something else.")
    zarr.open_group(str(path), mode="w", zarr_format=3).attrs.update(
        {"kind": KIND, "format": FORMAT, "identity": identity})
    return []


def commit_index(path: str | Path, stats: NeuronStats, corpus: dict[str, np.ndarray], attrs: dict[str, Any],
                 final: dict[str, np.ndarray] | None = None) -> None:
    """Replace the index's sealed group with ``stats``, the ``corpus`` arrays (prompt tokens, offsets, lines,
    vocabulary) and ``attrs`` (``shards`` counted, ``complete``, ...); ``final`` adds the write effects."""
    arrays = {**stats.arrays(), "edges": EDGES, **corpus, **(final or {})}
    write_sealed(Path(path), GROUP, arrays, {**attrs, "n_tokens": stats.n_tokens, "k": stats.k},
                 f"write the neuron index {path}", DIMS)


def index_state(path: str | Path) -> NeuronStats:
    """The statistics the index's last commit holds (a resumed run goes on from them); its seal checked."""
    found = read_sealed(Path(path) / GROUP, f"neuron index {path}", hint="Re-run `detjac neurons` with --force-new.")
    if found is None:
        raise StoreError(f"Expected a committed neuron index at {path}. Got none.")
    return NeuronStats.of(found[0], int(found[1]["n_tokens"]))


@dataclass
class NeuronIndex:
    """A complete neuron index, read whole (see the module docstring); :mod:`detjac.analysis` and the viewer read
    pages from it."""

    path: Path
    identity: dict[str, Any]
    attrs: dict[str, Any]
    arrays: dict[str, np.ndarray]
    _vocab: dict[int, str] | None = None

    @property
    def stats(self) -> NeuronStats:
        return NeuronStats.of(self.arrays, int(self.attrs["n_tokens"]))

    @property
    def shape(self) -> tuple[int, int]:
        """(layers, neurons per layer)."""
        return tuple(self.arrays["n_positive"].shape)  # type: ignore[return-value]

    def check(self, wanted: dict[str, Any]) -> None:
        """Raise :class:`NeuronIndexMismatch` unless the index was made with ``wanted`` (e.g. the model's
        ``weights_sha256``)."""
        check_identity(self.path, self.identity, wanted)

    def token_text(self, ids: Any) -> list[str]:
        """The texts of token ids (those of the corpus and of the write effects), ``?`` for one not kept."""
        if self._vocab is None:
            raw, off = self.arrays["vocab_utf8"].tobytes(), self.arrays["vocab_offsets"]
            self._vocab = {int(i): raw[off[j]:off[j + 1]].decode("utf-8", "surrogatepass")
                           for j, i in enumerate(self.arrays["vocab_ids"].tolist())}
        return [self._vocab.get(int(i), "?") for i in np.asarray(ids).ravel()]

    def prompt_tokens(self, prompt: int) -> np.ndarray:
        off = self.arrays["prompt_offsets"]
        return self.arrays["prompt_tokens"][off[prompt]:off[prompt + 1]]


def open_neuron_index(path: str | Path) -> NeuronIndex:
    """The complete neuron index at ``path``, its seal checked (every file's SHA-256).

    Raises
    ------
    InvalidArgumentError
        No neuron index at ``path``.
    StoreError
        An index a run has not finished (re-run the same command), or a damaged one (CorruptError).
    """
    path = Path(path)
    if not (path / "zarr.json").is_file() or not os.path.isdir(path):
        raise InvalidArgumentError(f"Expected a neuron index (made by `detjac neurons`) at {path}. Got no such index.")
    root = read_json(path / "zarr.json").get("attributes", {})
    if root.get("kind") != KIND:
        raise InvalidArgumentError(f"Expected a neuron index (made by `detjac neurons`) at {path}. Got another "
                                   "zarr group.")
    found = read_sealed(path / GROUP, f"neuron index {path}", hint="Re-run `detjac neurons` with --force-new.")
    if found is None or not found[1].get("complete"):
        raise StoreError(f"Expected a complete neuron index at {path}. Got one a run has not finished: run the "
                         "same `detjac neurons` command again to resume it.")
    arrays, attrs = found
    return NeuronIndex(path, dict(root.get("identity", {})), attrs, arrays)
