"""The zarr backend, writing one prompt: staged in ``_staging/<id>.<host>.<pid>.<random>`` and renamed into
``prompts/<id>`` at commit (``docs/store-format.md``, "Visibility rule"). It knows the store only through
:class:`Publisher`, so it does not import the store's own module.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from detjac.errors import InvalidArgumentError, StoreError
from detjac.targets import COMPONENTS, Target

from .. import format as fmt
from ..graph_tables import dimensions, graph_tables
from ..integrity import INTEGRITY, check_prompt_id, refuse_links, seal
from ..stored_prompt import LayerwiseSpec, PromptWriter
from ..subspace import Triplets
from .disk import disk_error, disk_refusal, fsync_dir, fsync_tree


class Publisher(Protocol):
    """What a prompt writer needs of its store."""

    path: Path  # the store folder

    def check_writer(self) -> None:
        """Raise StoreError unless the run that opened the store still holds it."""

    def clear_failure(self, prompt_id: str) -> None:
        """Remove the failure record of a prompt that is now committed."""


class ZarrPromptWriter(PromptWriter):
    """Writes one prompt group under ``_staging``; row blocks are grouped into whole shards."""

    def __init__(self, store: Publisher, prompt_id: str, *, n_rows: int, n_tokens: int, n_cols: int, dtype: str,
                 row_block: int, rank: int | None = None, layerwise: dict[str, LayerwiseSpec] | None = None,
                 shard_bytes: int | None = None, jacobian: bool = True, graph: bool = False) -> None:
        import zarr

        if shard_bytes is not None and (isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int)
                                        or shard_bytes < 1):
            raise StoreError(f"Expected shard_bytes to be a positive integer or None. Got {shard_bytes!r}.")

        check_prompt_id(prompt_id)
        self.id, self.n_rows, self.n_tokens, self.dtype, self.rank = prompt_id, n_rows, n_tokens, dtype, rank
        self.jacobian = jacobian and rank is None  # False: small arrays only (--keep none)
        self.n_cols = n_cols
        self.graph = graph  # True: the prompt is complete only with its attribution graph (`detjac run --graph`)
        self.layerwise = dict(layerwise or {})
        if self.layerwise and rank is not None:
            raise StoreError(f"Expected full mode for layerwise Jacobians of prompt {prompt_id}. Got rank {rank}.")
        for name, spec in self.layerwise.items():
            _check_layerwise(prompt_id, name, spec)
        self._covered: dict[str, int] = {}  # elements (rows x tokens) written per region-written Jacobian
        self.store = store
        self.final = store.path / fmt.PROMPTS / prompt_id
        attempt = f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
        self.staging = store.path / fmt.STAGING / f"{prompt_id}.{attempt}"
        self._written: set[str] = set()
        self._buffer: np.ndarray | None = None  # the shard being filled, rows from _buffer_start
        self._filled = self._buffer_start = self._next_row = 0
        self.shard_rows = fmt.shard_rows(row_block, n_rows, n_tokens * n_cols * np.dtype(dtype).itemsize,
                                         fmt.SHARD_BYTES if shard_bytes is None else shard_bytes)
        with disk_refusal(f"start prompt {prompt_id} in {store.path}", self.abort):
            refuse_links(store.path, fmt.STAGING)
            refuse_links(store.path, fmt.PROMPTS)
            (store.path / fmt.STAGING).mkdir(exist_ok=True)
            fmt.ensure_group(store.path / fmt.STAGING)
            shutil.rmtree(self.staging, ignore_errors=True)
            group = zarr.open_group(str(self.staging), mode="w", zarr_format=3)
            shapes = {"jacobian": ((n_rows, n_tokens, n_cols), dtype), "embeddings": ((n_tokens, n_cols), dtype),
                      "output": ((n_rows,), dtype), "token_ids": ((n_tokens,), "int64")}
            if not self.jacobian:
                del shapes["jacobian"]
            self._arrays = {}
            for name, (shape, dt) in shapes.items():
                big = name == "jacobian"
                self._arrays[name] = group.create_array(
                    name, shape=shape, dtype=dt, dimension_names=fmt.DIMENSIONS[name],
                    chunks=(min(row_block, n_rows), n_tokens, n_cols) if big else shape,
                    shards=(self.shard_rows, n_tokens, n_cols) if big else None,
                    compressors=fmt.compressors(np.dtype(dt).itemsize), fill_value=0, config=fmt.EVERY_CHUNK)
            self._group = group
            for name, spec in self.layerwise.items():
                self._create_layerwise(group, name, spec, n_cols, row_block)

    def write_rows(self, start: int, stop: int, values: np.ndarray) -> None:
        if self.rank is not None:
            raise StoreError(f"Expected triplets for prompt {self.id} (low-rank mode). Got jacobian rows.")
        if not self.jacobian:
            raise StoreError(f"Expected no Jacobian for prompt {self.id} (--keep none). Got jacobian rows.")
        values = np.asarray(values)
        if start != self._next_row or stop <= start or stop > self.n_rows or values.shape[0] != stop - start:
            raise StoreError(f"Expected jacobian rows starting at {self._next_row} for prompt {self.id}. "
                             f"Got rows {start}:{stop} with {values.shape[0]} values.")
        if values.shape[1:] != (self.n_tokens, self.n_cols):
            raise StoreError(f"Expected jacobian rows of shape (rows, {self.n_tokens}, {self.n_cols}) for prompt "
                             f"{self.id}. Got values of shape {values.shape}.")
        self._next_row = stop
        done = 0
        while done < len(values):  # fill whole shards; a shard that comes whole is written without a copy
            rows = min(self.shard_rows, self.n_rows - self._buffer_start)
            if self._filled == 0 and len(values) - done >= rows:
                self._write_shard(values[done:done + rows])
                done += rows
                continue
            if self._buffer is None:
                self._buffer = np.empty((rows, self.n_tokens, self.n_cols), dtype=self.dtype)
            take = min(len(values) - done, rows - self._filled)
            self._buffer[self._filled:self._filled + take] = values[done:done + take]
            self._filled += take
            done += take
            if self._filled == rows:
                buffer, self._buffer, self._filled = self._buffer, None, 0
                self._write_shard(buffer)

    def _write_shard(self, block: np.ndarray) -> None:
        with disk_refusal(f"write prompt {self.id}", self.abort):
            self._arrays["jacobian"][self._buffer_start:self._buffer_start + len(block)] = block
        self._buffer_start += len(block)
        if self._buffer_start == self.n_rows:
            self._written.add("jacobian")

    def _create_layerwise(self, group: Any, name: str, spec: LayerwiseSpec, n_cols: int, row_block: int) -> None:
        sub = group.require_group(fmt.LAYERWISE).create_group(name)
        sub.attrs.update({"layer": spec.layer, "component": spec.component, "local": spec.local, "mode": spec.mode})
        n, d = self.n_tokens, self.n_rows
        # chunks follow the blocks the engine produces: row blocks (reverse mode) or token blocks (forward mode)
        chunks = (d, min(spec.token_block, n), n_cols) if spec.mode == "forward" else (min(row_block, d), n, n_cols)
        itemsize = np.dtype(self.dtype).itemsize
        arrays = {"jacobian": ((d, n, n_cols), chunks), "output": ((d,), (d,))}
        source = _source_array(spec)
        if source is not None:  # what the Jacobian multiplies, when not the input embeddings
            arrays[source] = ((n, n_cols), (n, n_cols))
        for array, (shape, chunk) in arrays.items():
            sub.create_array(array, shape=shape, dtype=self.dtype, dimension_names=fmt.DIMENSIONS[array],
                             chunks=chunk, compressors=fmt.compressors(itemsize), fill_value=0,
                             config=fmt.EVERY_CHUNK)

    def write_block(self, target: str, start: int, stop: int, token_start: int, token_stop: int,
                    values: np.ndarray) -> None:
        """Jacobian rows ``start:stop`` x tokens ``token_start:token_stop`` of ``target``.

        ``target`` is ``"jacobian"`` (the prompt's Jacobian) or the name of a layerwise target
        given to ``begin``. Blocks may come in any order and must not overlap; a Jacobian counts
        as written when its blocks cover it.
        """
        if target == "jacobian" and ((token_start, token_stop) == (0, self.n_tokens) or not self.jacobian):
            self.write_rows(start, stop, values)
            return
        if target != "jacobian" and target not in self.layerwise:
            raise StoreError(f"Expected 'jacobian' or a layerwise target of prompt {self.id} "
                             f"({', '.join(self.layerwise) or 'none'}). Got {target!r}.")
        shape = (stop - start, token_stop - token_start)
        if not (0 <= start < stop <= self.n_rows and 0 <= token_start < token_stop <= self.n_tokens) \
                or tuple(values.shape[:2]) != shape:
            raise StoreError(f"Expected a block inside ({self.n_rows} rows, {self.n_tokens} tokens) of {target} for "
                             f"prompt {self.id}. Got rows {start}:{stop}, tokens {token_start}:{token_stop} with "
                             f"values of shape {tuple(values.shape)}.")
        arr = self._arrays["jacobian"] if target == "jacobian" else self._group[f"{fmt.LAYERWISE}/{target}/jacobian"]
        with disk_refusal(f"write prompt {self.id}", self.abort):
            arr[start:stop, token_start:token_stop] = values
        self._covered[target] = self._covered.get(target, 0) + shape[0] * shape[1]
        if self._covered[target] == self.n_rows * self.n_tokens:
            self._written.add(target)

    def write_layerwise(self, target: str, array: str, values: np.ndarray) -> None:
        """A layerwise target's ``output`` (row,) -- the value its Jacobian reconstructs -- or what it multiplies:
        ``inputs`` (token, col) of a per-layer (``*_local``) target, ``input`` (token, col) of ``to_output``."""
        spec = self.layerwise.get(target)
        source = _source_array(spec) if spec is not None else None
        allowed = ("output", source) if source is not None else ("output",)
        if spec is None or array not in allowed:
            raise StoreError(f"Expected one of {', '.join(allowed)} for a layerwise target of prompt {self.id} "
                             f"({', '.join(self.layerwise) or 'none'}). Got {target!r} / {array!r}.")
        with disk_refusal(f"write prompt {self.id}", self.abort):
            self._group[f"{fmt.LAYERWISE}/{target}/{array}"][...] = values
        self._written.add(f"{target}/{array}")

    def write_array(self, name: str, values: np.ndarray) -> None:
        allowed = (*fmt.SMALL_ARRAYS, *fmt.OPTIONAL_ARRAYS)
        if name not in allowed:
            raise InvalidArgumentError(f"Expected one of {', '.join(allowed)}. Got {name!r}.")
        if name in fmt.OPTIONAL_ARRAYS and np.shape(values) != (self.n_rows,):
            raise StoreError(f"Expected {name} of shape ({self.n_rows},) for prompt {self.id}. "
                             f"Got {np.shape(values)}.")
        with disk_refusal(f"write prompt {self.id}", self.abort):
            if name in fmt.OPTIONAL_ARRAYS:
                self._arrays[name] = fmt.put_array(self._group, name, np.asarray(values, dtype=self.dtype),
                                                   fmt.DIMENSIONS[name])
                self._written.add(name)
                return
            self._arrays[name][...] = values
        self._written.add(name)

    def write_graph(self, data: dict[str, Any]) -> None:
        """The prompt's attribution graph (circuit-tracer's JSON object) as the ``graph`` group's tables."""
        arrays, attrs = graph_tables(data)
        bad = fmt.non_standard_json(attrs)
        if bad:
            self.abort()
            raise StoreError(f"Expected the graph of prompt {self.id} in standard JSON. Got {bad}: nothing was "
                             "committed.")
        try:
            group = self._group.create_group(fmt.GRAPH)
            group.attrs.update(attrs)
            for name, values in arrays.items():
                dims = dimensions(name)
                chunks = tuple(max(1, size) for size in values.shape)
                if values.dtype.kind == "U":  # the labels: zarr-python's variable-length strings, checksummed too
                    arr = group.create_array(name, shape=values.shape, dtype=str, dimension_names=dims, chunks=chunks,
                                             compressors=fmt.compressors(1), fill_value="", config=fmt.EVERY_CHUNK)
                else:
                    arr = fmt.new_array(group, name, values.shape, values.dtype, dims, chunks)
                arr[...] = values
        except OSError as exc:
            self.abort()
            raise disk_error(exc, f"write prompt {self.id}") from exc
        self._written.add(fmt.GRAPH)

    def commit(self, attrs: dict[str, Any]) -> None:
        kept = ["jacobian"] if self.jacobian else ["triplets"] if self.rank is not None else []
        missing = {*kept, *fmt.SMALL_ARRAYS, *([fmt.GRAPH] if self.graph else [])} - self._written
        for name, spec in self.layerwise.items():
            source = _source_array(spec)
            missing |= {name, f"{name}/output", *([f"{name}/{source}"] if source else [])} - self._written
        if missing:
            self.abort()
            raise StoreError(f"Expected every array of prompt {self.id} before commit. Got none for "
                             f"{', '.join(sorted(missing))} (rows written: {self._next_row} of {self.n_rows}).")
        bad = fmt.non_standard_json(attrs)
        if bad:
            self.abort()
            raise StoreError(f"Expected attributes of prompt {self.id} in standard JSON (readable by every zarr "
                             f"reader). Got {bad}: nothing was committed.")
        try:
            coordinates = fmt.put_token_coordinates(self._group, self.n_tokens, attrs.get("tokens"))
            self._group.attrs.update({**attrs, **coordinates, "complete": True})
            written = json.loads((self.staging / "zarr.json").read_text())["attributes"]  # as readers will see them
            self._group.attrs.update({INTEGRITY: seal(self.staging, written)})
            fmt.consolidate(self.staging)
            fsync_tree(self.staging)
            self.store.check_writer()
            if self.final.exists():  # the same prompt was stored meanwhile: keep the first
                self.abort()
                return
            os.rename(self.staging, self.final)
            fsync_dir(self.final.parent)
        except OSError as exc:
            self.abort()
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and self.final.exists():
                return  # another attempt at the same prompt committed first: it is stored once
            if isinstance(exc, StoreError):
                raise
            raise disk_error(exc, f"commit prompt {self.id}") from exc
        self.store.clear_failure(self.id)  # a prompt is complete or failed, never both

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def write_triplets(self, per_token: Sequence[Triplets], combined: Triplets) -> dict[str, Any]:
        if self.rank is None:
            raise StoreError(f"Expected jacobian rows for prompt {self.id} (full mode). Got triplets.")
        arrays = {
            "token_U": (np.stack([t.U for t in per_token]), ("token", "row", "rank")),
            "token_S": (np.stack([t.S for t in per_token]), ("token", "rank")),
            "token_V": (np.stack([t.V for t in per_token]), ("token", "col", "rank")),
            "token_frobenius_sq": (np.array([t.frobenius_sq for t in per_token]), ("token",)),
            "token_residual_sq": (np.array([t.residual_sq for t in per_token]), ("token",)),
            "combined_U": (combined.U, ("row", "rank")),
            "combined_S": (combined.S, ("rank",)),
            "combined_V": (combined.V.reshape(len(per_token), -1, combined.V.shape[-1]), ("token", "col", "rank")),
        }
        with disk_refusal(f"write prompt {self.id}", self.abort):
            for name, (values, dims) in arrays.items():
                fmt.put_array(self._group, name, values.astype(self.dtype), dims)
        self._written.add("triplets")
        return {"keep": str(fmt.Keep(rank=self.rank)), "rank": int(combined.S.shape[0]),
                "combined_frobenius_sq": combined.frobenius_sq, "combined_residual_sq": combined.residual_sq,
                "combined_captured": combined.captured}


def _source_array(spec: LayerwiseSpec) -> str | None:
    """The array a layerwise target's Jacobian multiplies (``inputs``, ``input``), None: the input embeddings."""
    return Target(spec.layer, spec.component, spec.local).source_array


def _check_layerwise(prompt_id: str, name: str, spec: LayerwiseSpec) -> None:
    """A layerwise target is stored under its name in the target grammar (``detjac.targets``), e.g. ``mlp_local.3``."""
    expected = Target(spec.layer, spec.component, spec.local).name if spec.component in COMPONENTS else None
    if name != expected or spec.layer < 0 or spec.mode not in ("reverse", "forward"):
        raise StoreError(f"Expected a layerwise target named COMPONENT[_local].LAYER after its spec, with COMPONENT "
                         f"one of {', '.join(COMPONENTS)}, a layer >= 0 and mode reverse or forward, for prompt "
                         f"{prompt_id}. Got {name!r} for {spec}.")
