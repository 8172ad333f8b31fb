"""What ``detjac store info|verify|export`` report about a store, read through its reader interface.

:func:`store_summary` also sizes the store's folder on disk. Nothing here writes to a store.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from detjac.outputs import check_output

from .backend.disk import npz_name, write_npz
from .reader import StoreReader, VerifyResult


@dataclass(frozen=True)
class StoreSummary:
    """A store's run description and counts: complete prompts (and the damaged ones among them, with why), bytes
    on disk, partial and failed prompts."""

    format_version: int
    created: str | None
    run: dict[str, Any]
    complete: int
    disk_bytes: int
    staging_leftovers: list[str]
    failures: dict[str, dict[str, Any]]
    damaged: dict[str, str]


@dataclass(frozen=True)
class Listed:
    """One complete prompt as ``store ls`` shows it: its attributes, or why it cannot be read."""

    id: str
    attrs: dict[str, Any] | None
    damage: str | None = None


@dataclass(frozen=True)
class PromptLayout:
    """How one prompt's Jacobian is kept: whole (``shape``, ``dtype``, ``chunks``) or as low-rank triplets
    (``triplet_shapes`` of the combined U, S, V; per-token triplets of ``rank`` for ``n_tokens`` tokens)."""

    attrs: dict[str, Any]
    low_rank: bool
    n_tokens: int
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    chunks: tuple[int, ...] | None = None
    triplet_shapes: tuple[tuple[int, ...], ...] | None = None
    rank: int | None = None


@dataclass(frozen=True)
class VerifySummary:
    """Every :class:`VerifyResult` (prompts, then the other parts), the corrupt ones, and the worst reconstruction
    error of the prompts that are ok."""

    results: list[VerifyResult]
    corrupt: list[VerifyResult]
    worst_error: float | None  # None: no ok prompt holds a Jacobian to reconstruct (--keep none, low rank)
    format_version: int = 2
    interrupted: list[str] = field(default_factory=list)  # what killed writes left (never read as results)

    @property
    def prompts(self) -> int:
        return sum(r.kind == "prompt" for r in self.results)

    @property
    def ok(self) -> int:
        """Prompts that are ok."""
        return self.prompts - sum(r.kind == "prompt" for r in self.corrupt)

    @property
    def parts(self) -> int:
        """Other parts checked (model arrays, analysis results, failure records, stray entries)."""
        return len(self.results) - self.prompts


def store_summary(store: StoreReader) -> StoreSummary:
    """The run description, the counts and the size on disk of ``store`` (a store in a local folder)."""
    size = 0
    for here, _, files in os.walk(store.path):  # symlinks are not followed (nor counted)
        size += sum(os.lstat(os.path.join(here, name)).st_size for name in files)
    damaged = {row.id: row.damage for row in listing(store) if row.damage is not None}
    return StoreSummary(store.format_version, store.created, store.run, len(store), size,
                        store.staging_leftovers(), store.failures(), damaged)


def listing(store: StoreReader, contains: str | None = None) -> list[Listed]:
    """Every complete prompt whose text contains ``contains``, or that is damaged (its reason instead of its
    attributes: a damaged prompt is listed whatever ``contains`` says)."""
    from ..errors import StoreError
    from .integrity import damage_reason

    rows = []
    for pid in store.prompt_ids():
        try:
            attrs = store.get(pid).attrs
        except StoreError as exc:
            rows.append(Listed(pid, None, damage_reason(exc)))
            continue
        if contains is None or contains in str(attrs.get("prompt", "")):
            rows.append(Listed(pid, attrs))
    return rows


def prompt_layout(prompt: Any) -> PromptLayout:
    """How ``prompt``'s Jacobian is kept (reads the low-rank triplets, or only the full array's metadata)."""
    if prompt.low_rank:
        U, S, V = prompt.triplets()
        return PromptLayout(prompt.attrs, True, prompt.n_tokens, triplet_shapes=(U.shape, S.shape, V.shape),
                            rank=S.shape[0])
    if prompt.without_jacobian:
        return PromptLayout(prompt.attrs, False, prompt.n_tokens)
    arr = prompt.jacobian()
    return PromptLayout(prompt.attrs, False, prompt.n_tokens, shape=tuple(arr.shape), dtype=str(arr.dtype),
                        chunks=arr.chunksize)


def verify_summary(store: StoreReader, progress: bool = False) -> VerifySummary:
    """Re-read every complete prompt (:meth:`~detjac.store.reader.StoreReader.verify`) and sort the results."""
    results = store.verify(progress=progress)
    corrupt = [r for r in results if not r.ok]
    worst = max((r.reconstruction_error for r in results if r.ok and r.reconstruction_error is not None),
                default=None)
    return VerifySummary(results, corrupt, worst, store.format_version, store.interrupted_writes())


def export_npz(store: StoreReader, prompt_id: str, out: str | Path, force: bool = False) -> Path:
    """Write one prompt's arrays and its attrs (as JSON text, no pickles) to the numpy ``.npz`` file ``out``.

    The arrays: ``embeddings``, ``output``, ``token_ids``, ``bias`` when stored, and ``jacobian``
    (row, token, col), or for a low-rank prompt ``combined_U``/``combined_S``/``combined_V`` and the
    per-token ``token_U``, ``token_S``, ``token_V``, ``token_frobenius_sq``. Returns the file written
    (``.npz`` added to a name without it). The file is written aside and renamed into place; an existing
    one is replaced only with ``force``; a target refused by :func:`detjac.outputs.check_output` (inside the store
    read, inside any store or index, ...) is an InvalidArgumentError before anything is read.
    """
    target = check_output(npz_name(out), force=force, suffix=".npz", reads=[("the store", store.path)])
    prompt: Any = store.get(prompt_id)
    arrays = {name: prompt.array(name) for name in ("embeddings", "output", "token_ids")}
    if prompt.bias() is not None:
        arrays["bias"] = prompt.bias()
    if prompt.low_rank:
        arrays.update({f"combined_{x}": a for x, a in zip("USV", prompt.triplets(), strict=True)})
        arrays.update({name: prompt.array(name) for name in ("token_U", "token_S", "token_V", "token_frobenius_sq")})
    elif not prompt.without_jacobian:
        arrays["jacobian"] = prompt.jacobian(lazy=False)
    return write_npz(target, {"attrs": np.array(json.dumps(prompt.attrs)), **arrays})


def export_graph(store: StoreReader, prompt_id: str, out: str | Path, force: bool = False) -> Path:
    """Write one prompt's attribution graph (stored by ``detjac run --graph``) to ``out`` as circuit-tracer's graph
    JSON: the object :meth:`~detjac.store.StoredPrompt.graph` returns, its ``metadata.slug`` set to the file's name
    (circuit-tracer's server answers ``SLUG.json``), and list it in ``graph-metadata.json`` beside it, so
    ``circuit_tracer.frontend`` and ``detjac view FOLDER`` open the folder. Each file is written aside and renamed
    into place; an existing graph file is replaced only with ``force`` (InvalidArgumentError before anything is read
    otherwise, as for any target :func:`detjac.outputs.check_output` refuses).

    Raises
    ------
    InvalidArgumentError
        ``out`` is not a new ``.json`` file (without ``force``), or the prompt was stored without a graph.
    """
    from detjac.errors import InvalidArgumentError
    from detjac.graph_index import slug_of, write_graph_file

    from .backend.disk import disk_refusal

    target = check_output(out, force=force, suffix=".json", reads=[("the store", store.path)])
    graph = store.get(prompt_id).graph()
    if graph is None:
        raise InvalidArgumentError(f"Expected a prompt stored with its attribution graph (`detjac run --graph`). Got "
                                   f"prompt {prompt_id}, stored without one; nothing was written.")
    graph["metadata"] = {**graph["metadata"], "slug": slug_of(target)}
    with disk_refusal(f"write {target}"):
        return write_graph_file(target, graph)
