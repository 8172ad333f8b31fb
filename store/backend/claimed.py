"""Shapes a group's array metadata claims, checked before any array is read (``docs/store-format.md``, "Integrity").

A seal proves that files are what was committed, not that what was committed is sane: a ``zarr.json`` edited and
resealed can claim a Jacobian of ``[256, 8, 1e9]`` or a node table of 1e11 rows, and zarr allocates what it claims
before a chunk is decoded. So every array's claimed shape is read from its metadata alone and held against what
the group says elsewhere: the sizes a dimension must have (a prompt's ``token`` is its ``n_tokens``, ``row`` and
``col`` the model's width), every array that names a dimension agreeing on its size, and the bytes of all arrays
within the memory this machine has. Nothing here reads array data.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from detjac import machine
from detjac.safe_json import read_json

from ..integrity import CorruptError


def claimed_arrays(folder: Path) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...], int, tuple[int, ...]]]:
    """Every array under the group ``folder``: its path relative to it -> (shape, dimension names, item bytes, chunk
    shape), from its ``zarr.json`` alone. Raises CorruptError for metadata that does not state a shape of sizes."""
    found = {}
    for here, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "c"  # "c": an array's chunks
                         and not (Path(here) / d).is_symlink())
        if "zarr.json" not in names or Path(here) == folder:
            continue
        rel = Path(here).relative_to(folder).as_posix()
        try:
            meta = read_json(Path(here) / "zarr.json")
        except (OSError, ValueError) as exc:
            raise CorruptError(f"unreadable metadata of {rel}: {exc}") from None
        if not isinstance(meta, dict) or meta.get("node_type") != "array":
            continue
        shape, names_ = meta.get("shape"), meta.get("dimension_names")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise CorruptError(f"array {rel} claims shape {str(shape)[:80]}, not a list of sizes")
        if not isinstance(names_, list) or len(names_) != len(shape):
            names_ = [None] * len(shape)
        found[rel] = (tuple(shape), tuple(n if isinstance(n, str) else None for n in names_), _itemsize(meta),
                      _chunk(meta, shape))
    return found


def _chunk(meta: dict[str, Any], shape: list[int]) -> tuple[int, ...]:
    """The (outer) chunk shape the metadata claims, each side at most the array's; the array's shape without one."""
    grid = ((meta.get("chunk_grid") or {}).get("configuration") or {}).get("chunk_shape") \
        if isinstance(meta.get("chunk_grid"), dict) else None
    if not isinstance(grid, list) or len(grid) != len(shape) or not all(type(n) is int and n > 0 for n in grid):
        return tuple(shape)
    return tuple(min(c, n) for c, n in zip(grid, shape, strict=True))


def _itemsize(meta: dict[str, Any]) -> int:
    try:
        return max(np.dtype(str(meta.get("data_type"))).itemsize, 1)
    except TypeError:
        return 8  # strings and other extension types: counted as a pointer each


def check_claimed(folder: Path, what: str, sizes: dict[str, int] | None = None,
                  at_most: dict[str, int] | None = None, whole: bool = True) -> dict[str, int]:
    """Refuse (CorruptError) the group at ``folder`` if its arrays claim shapes it cannot hold; return the size of
    each named dimension.

    Parameters
    ----------
    folder : Path
        The group's folder (its arrays and subgroups' arrays are read from their metadata only).
    what : str
        What the group is, for the message ("prompt 3f2a... in run.zarr").
    sizes : dict or None
        Dimension name -> the size every array naming it must have (``token``: the prompt's ``n_tokens``).
    at_most : dict or None
        Dimension name -> the largest size it may have (a graph's ``node``: its nodes before pruning).
    whole : bool
        The arrays are read whole (a sealed group, a graph): their claimed bytes must fit in the memory this machine
        has. Without (a prompt's Jacobian, read a chunk at a time), the largest chunk must.

    Raises
    ------
    CorruptError
        A dimension of another size than ``sizes`` says or than another array gives it, one past ``at_most``, or
        a rank past what its matrix has, or arrays (``whole``; else the largest chunk) whose claimed bytes exceed the
        memory this machine has.
    """
    arrays = claimed_arrays(folder)
    agreed = dict(sizes or {})
    for rel, (shape, names, _, _) in sorted(arrays.items()):
        for size, name in zip(shape, names, strict=True):
            if name is None:
                continue
            if name in agreed and agreed[name] != size:
                source = "the group says" if name in (sizes or {}) else "other arrays have"
                raise CorruptError(f"Expected the arrays of {what} to agree with it. Got {rel} claiming shape "
                                   f"{list(shape)}: its {name} dimension has {size}, {source} {agreed[name]}")
            agreed[name] = size
            if at_most and name in at_most and size > at_most[name]:
                raise CorruptError(f"Expected the arrays of {what} to agree with it. Got {rel} claiming shape "
                                   f"{list(shape)}: its {name} dimension has {size}, at most {at_most[name]} fit")
    if "rank" in agreed and "row" in agreed and "col" in agreed and "token" in agreed and \
            agreed["rank"] > min(agreed["row"], agreed["token"] * agreed["col"]):
        raise CorruptError(f"Expected the arrays of {what} to agree with it. Got a rank of {agreed['rank']}, more than "
                           f"a ({agreed['row']}, {agreed['token']} x {agreed['col']}) matrix has")
    available = machine.available_memory()
    if whole:  # read whole: all of it at once
        total, part = sum(math.prod(a[0]) * a[2] for a in arrays.values()), "arrays claiming"
    else:  # read a chunk at a time: the largest chunk at once
        total, part = max((math.prod(a[3]) * a[2] for a in arrays.values()), default=0), "a chunk claiming"
    if available is not None and total > available:
        raise CorruptError(f"Expected the arrays of {what} to fit in memory. Got {part} {total / 2**30:.1f} GiB, more "
                           f"than this machine's {available / 2**30:.1f} GiB available")
    return agreed


def prompt_bounds(path: Path, n_tokens: int) -> tuple[dict[str, int], dict[str, int]]:
    """(sizes, at_most) of the prompt group at ``path`` for :func:`check_claimed`: ``token`` its ``n_tokens``, and a
    graph's ``node`` and ``link`` at most its nodes before pruning (and their square), with its QK-only nodes
    (``qk_nodes``) for ``node`` and the QK records' dimensions."""
    sizes = {"token": n_tokens}
    at_most: dict[str, int] = {}
    graph = path / "graph" / "zarr.json"
    if graph.is_file():
        try:
            info = ((read_json(graph).get("attributes") or {}).get("metadata") or {}).get("info") or {}
        except (OSError, ValueError, AttributeError):
            info = {}
        before = info.get("nodes_before_pruning") if isinstance(info, dict) else None
        qk = info.get("qk_nodes", 0) if isinstance(info, dict) else 0  # QK-only nodes, added after pruning
        if type(before) is int and before >= 0 and type(qk) is int and qk >= 0:
            nodes = before + qk  # a record's own node is QK-only; its pairs and marginals name nodes
            at_most.update(node=nodes, link=before * before, loaded=before * before, qk_record=qk,
                           qk_pair=qk * nodes * nodes, qk_q=qk * nodes, qk_k=qk * nodes)
    return sizes, at_most
