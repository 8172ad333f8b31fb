"""A neuron index on disk (``detjac neurons``): a folder holding one sealed zarr group, ``index``, replaced whole
and atomically at every commit (:func:`detjac.store.write_sealed`), so a killed run leaves the last commit intact
and resumes from the shards it lists. The sealed group's attributes hold the index's identity (the model, the
corpus, K and the shard layout), checked against its arrays whenever it is read; the root's attributes say only
what the folder is. An index asked for by another model or other settings is refused, naming what differs. A run
writes it holding a lock kept beside the folder (:func:`writing_index`). Layout and rules: docs/store-format.md,
"Neuron indexes"."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DetjacError, InvalidArgumentError, StoreError
from ..safe_json import read_json
from .backend.sealed import read_sealed, write_sealed
from .integrity import CorruptError
from .neuron_checks import HINT, check_index
from .neuron_stats import EDGES, NeuronStats

KIND = "detjac-neuron-index"
FORMAT = 2  # 2: the identity sealed with the data (format 1 kept it in the root's attributes, which an edit changed)
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


def lock_path(path: str | Path) -> Path:
    """The index's lock file, ``<path>.lock``: beside its folder, so that replacing the folder (``--force-new``)
    keeps the lock."""
    path = Path(path).resolve()  # one lock per folder, whatever name reaches it
    return path.with_name(path.name + ".lock")


@contextmanager
def writing_index(path: str | Path) -> Iterator[None]:
    """Hold the writer lock of the index at ``path`` (:func:`lock_path`) while the body writes it: a second run
    on the same index is refused (StoreError naming the lock file and its holder) before it reads or writes."""
    from .backend.lock import hold, release

    lock = lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    held = hold(lock, f"the neuron index {path}")
    try:
        yield
    finally:
        release(held)


def _root_attrs(path: Path) -> dict[str, Any]:
    """The root group's attributes ({} where its zarr.json holds none, or holds something else)."""
    meta = read_json(path / "zarr.json")
    attrs = meta.get("attributes") if isinstance(meta, dict) else None
    return attrs if isinstance(attrs, dict) else {}


def _root(path: Path, error: type[DetjacError]) -> None:
    """Check the root group at ``path``: a neuron index of this format, its attributes ``kind`` and ``format`` only
    (the identity lives in the sealed group: a root that says more was edited)."""
    root = _root_attrs(path)
    if root.get("kind") != KIND:
        raise error(f"Expected a neuron index (made by `detjac neurons`) at {path}. Got another zarr group"
                    + ("; choose another --out." if error is StoreError else "."))
    if root.get("format") != FORMAT:
        raise StoreError(f"Expected a neuron index of format {FORMAT} at {path}. Got format {root.get('format')!r}"
                         + (", written before an index's identity was sealed with its data: rebuild it with the "
                            "same `detjac neurons` command and --force-new." if root.get("format") == 1 else
                            ", which this detjac does not read."))
    extra = sorted(set(root) - {"kind", "format"})
    if extra:
        raise CorruptError(f"Expected a neuron index whose root holds its kind and format only. Got {path} with "
                           f"{', '.join(extra)} added to its root's attributes (its identity is sealed in "
                           f"{GROUP}/). {HINT}")


def _sealed(path: Path, arrays: bool) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """(arrays, attrs) of the index's last commit, sealed and checked against its identity; None before one."""
    what = f"neuron index {path}"
    found = read_sealed(path / GROUP, what, arrays=arrays, hint=HINT)
    if found is not None:
        check_index(what, found[1], found[0] if arrays else None)
    return found


def start_index(path: str | Path, identity: dict[str, Any], force_new: bool = False) -> list[int]:
    """Create the index folder at ``path`` for ``identity`` (the model, the corpus and the settings), or find the
    one a killed run left; returns the shards its last commit counts (empty for a new index). Call it holding
    :func:`writing_index`.

    Raises
    ------
    NeuronIndexMismatch
        An index at ``path`` made with another identity (``force_new`` replaces it).
    StoreError
        Something at ``path`` that is not a neuron index of this format (``force_new`` replaces an older one), or
        a damaged one (CorruptError).
    """
    import shutil

    import zarr

    path = Path(path)
    if (path / "zarr.json").is_file():
        if not force_new:
            _root(path, StoreError)
            found = _sealed(path, arrays=False)
            if found is None:  # a run killed before its first commit: nothing counted yet
                return []
            check_identity(path, found[1]["identity"], identity)
            return list(found[1]["shards"])
        if _root_attrs(path).get("kind") != KIND:
            raise StoreError(f"Expected a neuron index (or nothing) at {path}. Got another zarr group; choose "
                             "another --out.")
        shutil.rmtree(path)
    elif path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise StoreError(f"Expected an empty folder or nothing at {path} for a neuron index. Got something else.")
    zarr.open_group(str(path), mode="w", zarr_format=3).attrs.update({"kind": KIND, "format": FORMAT})
    return []


def commit_index(path: str | Path, identity: dict[str, Any], stats: NeuronStats, corpus: dict[str, np.ndarray],
                 shards: list[int], final: dict[str, np.ndarray] | None = None) -> None:
    """Replace the index's sealed group with ``identity``, ``stats``, the ``corpus`` arrays (prompt tokens,
    offsets, lines, vocabulary) and the ``shards`` counted; ``final`` (the write effects) marks it complete."""
    arrays = {**stats.arrays(), "edges": EDGES, **corpus, **(final or {})}
    attrs = {"identity": identity, "shards": shards, "complete": final is not None, "n_tokens": stats.n_tokens}
    check_index(f"neuron index {path} to commit", attrs, arrays)  # never seal what a reader would refuse
    write_sealed(Path(path), GROUP, arrays, attrs, f"write the neuron index {path}", DIMS)


def index_state(path: str | Path) -> NeuronStats:
    """The statistics the index's last commit holds (a resumed run goes on from them); its seal checked."""
    found = _sealed(Path(path), arrays=True)
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
        ``family``, ``n_layers``, ``neurons_per_layer`` and ``weights_sha256``), each key compared as given: leave
        out what the asker does not know (a graph written from Python may carry no weights digest)."""
        check_identity(self.path, self.identity, wanted)

    def token_text(self, ids: Any) -> list[str]:
        """The texts of token ids (those of the corpus and of the write effects), ``?`` for one not kept."""
        if self._vocab is None:
            raw, off = self.arrays["vocab_utf8"].tobytes(), self.arrays["vocab_offsets"]
            self._vocab = {int(i): raw[off[j]:off[j + 1]].decode("utf-8", "surrogatepass")
                           for j, i in enumerate(self.arrays["vocab_ids"].tolist())}
        return [self._vocab.get(int(i), "?") for i in np.asarray(ids).ravel()]

    def prompt_tokens(self, prompt: int) -> np.ndarray:
        """The token ids of the corpus's prompt ``prompt`` (0-based; InvalidArgumentError outside the corpus, never
        Python's negative indexing)."""
        off = self.arrays["prompt_offsets"]
        if isinstance(prompt, bool) or not isinstance(prompt, int | np.integer) or not 0 <= prompt < off.size - 1:
            raise InvalidArgumentError(f"Expected a prompt in 0..{off.size - 2} of the neuron index {self.path}. Got "
                                       f"{prompt!r}.")
        return self.arrays["prompt_tokens"][off[prompt]:off[prompt + 1]]


def open_neuron_index(path: str | Path) -> NeuronIndex:
    """The complete neuron index at ``path``, its seal checked (every file's SHA-256), its identity checked against
    its arrays' shapes and every index it stores against what it indexes (:mod:`detjac.store.neuron_checks`).

    Raises
    ------
    InvalidArgumentError
        No neuron index at ``path``.
    StoreError
        An index a run has not finished (re-run the same command), one of an older format (rebuild it with
        ``--force-new``), or a damaged one (CorruptError).
    """
    path = Path(path)
    if not (path / "zarr.json").is_file() or not os.path.isdir(path):
        raise InvalidArgumentError(f"Expected a neuron index (made by `detjac neurons`) at {path}. Got no such index.")
    _root(path, InvalidArgumentError)
    found = _sealed(path, arrays=True)
    if found is None or not found[1].get("complete"):
        raise StoreError(f"Expected a complete neuron index at {path}. Got one a run has not finished: run the "
                         "same `detjac neurons` command again to resume it.")
    arrays, attrs = found
    return NeuronIndex(path, dict(attrs.pop("identity")), attrs, arrays)
