"""The on-disk format of a detjac store (version 2; version 1 is read); the spec is ``docs/store-format.md``.

Names of the folders and arrays, the run identity, codecs, and the root description
(:func:`read_root`). Pure numpy / zarr: nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, StoreFormatError, UnreadableJSONError
from ..numerals import parse_index
from ..safe_json import read_json
from .integrity import INTEGRITY, attrs_digest

FORMAT_VERSION = 2
SEALED_SINCE = 2  # format versions from this one seal groups, write every chunk and keep the lock in WRITER
ROOT_KEY = "detjac_store"  # root group attribute holding the run description
PROMPTS = "prompts"  # group of complete prompts: the only place readers look
STAGING = "_staging"  # prompts being written; renamed into PROMPTS when complete
FAILED = "failed"  # failure records of prompts a run could not compute: failed/<prompt_id>
LOCK = ".writer.lock"  # format 1's writer lock; format 2 keeps it in WRITER/zarr.json, a zarr group
WRITER = "_writer"
ANALYSIS = "analysis"  # results of detjac.analysis, per prompt: analysis/<prompt_id>/<name>
MODEL = "model"  # the model's embedding and unembedding matrices and tokenizer, for decoding
LENS = "lens"  # corpus-level lens groups (detjac.analysis.lens): lens/fitted, lens/partial-<layer>-<digest>
# Everything a store's root may hold (format 1's lock file included).
STORE_ENTRIES = frozenset({"zarr.json", PROMPTS, STAGING, FAILED, ANALYSIS, MODEL, LENS, WRITER, LOCK})

# Run settings that must match when a store is resumed (they change what is stored).
RUN_IDENTITY = ("model_id", "model_type", "config_sha256", "revision", "dtype", "keep", "detach", "position", "target",
                "layerwise", "quantize", "weights_sha256", "convention", "lens", "tokenizer_sha256", "graph")
# Identity keys added after the first stores were written: left out of prompt ids while unset, so the
# ids of runs that do not use them are unchanged.
OPTIONAL_IDENTITY = ("layerwise", "quantize", "weights_sha256", "convention", "lens", "tokenizer_sha256", "graph")
GRAPH = "graph"  # per-prompt group of the attribution graph's node and link tables (`detjac run --graph`)
LAYERWISE = "layerwise"  # per-prompt group of layerwise Jacobians: layerwise/<target>/{jacobian,output,inputs|input}

DIMENSIONS = {
    "jacobian": ("row", "token", "col"),
    "embeddings": ("token", "col"),
    "output": ("row",),
    "bias": ("row",),
    "token_ids": ("token",),
    "inputs": ("token", "col"),
    "input": ("token", "col"),
    "embedding": ("vocab", "col"),
    "unembedding": ("vocab", "row"),
    "final_norm": ("row",),
    "tokenizer": ("byte",),
    "token": ("token",),
    "token_text": ("token",),
}
MODEL_METADATA = "model_metadata_sha256"  # root key: {"<array>/zarr.json": sha256} of the model group's arrays
MODEL_FILES = {"tokenizer.json": "tokenizer"}  # files kept under model/, as uint8 arrays from format 2 on

COORDINATES = ("token", "token_text")  # xarray coordinates of a prompt's token dimension, written at commit
NO_JACOBIAN = "none"  # the keep of a prompt that stores no Jacobian (`detjac run --lens`, --keep none)
SMALL_ARRAYS = ("embeddings", "output", "token_ids")  # every prompt has these besides its Jacobian or triplets
OPTIONAL_ARRAYS = ("bias",)  # only affine models' prompts: the offset b of y = sum_k J_k x_k + b

EVERY_CHUNK = {"write_empty_chunks": True}  # all-zero chunks are written too: an absent chunk is a lost one
SHARD_BYTES = 16 * 2**20  # jacobian shards hold as many row blocks as fit in this many bytes (at least one)


@dataclass(frozen=True)
class Keep:
    """What a run keeps of each prompt's output Jacobian (``detjac run --keep``), parsed once from its text.

    ``full`` (the Jacobian, ``rank`` None), ``rank:K`` (the top ``K`` singular triplets, ``rank`` K) or ``none``
    (nothing: a ``--lens`` run's prompts, ``jacobian`` False). ``str(keep)`` is the text a store records.
    """

    rank: int | None = None
    jacobian: bool = True

    @classmethod
    def parse(cls, text: str | Keep) -> Keep:
        """The ``--keep`` text as a :class:`Keep` (a :class:`Keep` is returned as it is).

        Raises
        ------
        InvalidArgumentError
            Anything but ``full``, ``none`` or ``rank:K`` with ``K`` a positive integer.
        """
        if isinstance(text, Keep):
            return text
        if text in ("full", NO_JACOBIAN):
            return cls(jacobian=text == "full")
        kind, _, value = str(text).partition(":")
        rank = parse_index(value) if kind == "rank" else None
        if rank:  # a positive integer
            return cls(rank=rank)
        raise InvalidArgumentError(f"Expected --keep full, --keep rank:K with K a positive integer, or --keep none "
                                   f"(with --lens). Got {text!r}.")

    @classmethod
    def of_run(cls, run: Mapping[str, Any]) -> Keep:
        """The keep of a store's run description (``full`` where it records none)."""
        return cls.parse(run.get("keep") or "full")

    @classmethod
    def of_prompt(cls, attrs: Mapping[str, Any]) -> Keep:
        """The keep of one stored prompt, from the attributes committed with it: a low-rank prompt records its
        ``keep`` and ``rank``, a ``--lens`` prompt ``keep`` none, a full one neither."""
        if "rank" in attrs:
            return cls.parse(attrs.get("keep") or f"rank:{int(attrs['rank'])}")
        return cls(jacobian=attrs.get("keep") != NO_JACOBIAN)

    @property
    def low_rank(self) -> bool:
        """Whether triplets are kept instead of the Jacobian (``rank:K``)."""
        return self.rank is not None

    @property
    def full(self) -> bool:
        """Whether the whole Jacobian is kept."""
        return self.jacobian and self.rank is None

    def __str__(self) -> str:
        return f"rank:{self.rank}" if self.rank is not None else "full" if self.jacobian else NO_JACOBIAN


def storage_dtype(dtype: str) -> str:
    """The dtype a run's results are stored in: its compute dtype, but float32 for 16-bit ones (numpy has no
    bfloat16)."""
    return "float32" if dtype in ("bfloat16", "float16") else dtype


def now() -> str:
    """UTC timestamp, ISO 8601, seconds."""
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def prompt_id(run: dict[str, Any], prompt: str) -> str:
    """Stable 16-hex-digit id of ``prompt`` under a run's identity (model, revision, settings)."""
    identity = {key: run.get(key) for key in RUN_IDENTITY if key not in OPTIONAL_IDENTITY or run.get(key)}
    blob = json.dumps({"run": identity, "prompt": prompt}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def compressors(itemsize: int) -> list[Any]:
    """zstd with byte shuffle (blosc), then a crc32c checksum so bit rot is detected on read."""
    from zarr.codecs import BloscCodec, Crc32cCodec

    return [BloscCodec(cname="zstd", clevel=3, shuffle="shuffle", typesize=itemsize), Crc32cCodec()]


def new_array(group: Any, name: str, shape: tuple[int, ...], dtype: Any, dims: tuple[str, ...] | None = None,
              chunks: tuple[int, ...] | None = None) -> Any:
    """Create ``name`` in a zarr ``group`` with the store's codecs, unwritten (one chunk by default)."""
    dtype = np.dtype(dtype)
    return group.create_array(name, shape=shape, dtype=dtype, dimension_names=dims, chunks=chunks or shape or None,
                              compressors=compressors(dtype.itemsize), fill_value=0, config=EVERY_CHUNK)


def put_array(group: Any, name: str, values: Any, dims: tuple[str, ...] | None = None,
              chunks: tuple[int, ...] | None = None) -> Any:
    """Create ``name`` in a zarr ``group`` with the store's codecs and write ``values`` (one chunk by default)."""
    values = np.asarray(values)
    arr = new_array(group, name, values.shape, values.dtype, dims, chunks)
    arr[...] = values
    return arr


def put_token_coordinates(group: Any, n_tokens: int, tokens: list[str] | None) -> dict[str, str]:
    """Coordinates of a prompt's ``token`` dimension, for xarray: ``token`` (positions 0..n-1) and, with a
    tokenizer, ``token_text`` (the decoded pieces); returns the group attribute naming the non-dimension
    ones (``token_ids`` is one), which ``xarray.open_zarr`` reads as coordinates."""
    put_array(group, "token", np.arange(n_tokens, dtype=np.int64), DIMENSIONS["token"])
    names = ["token_ids"]
    if tokens is not None and len(tokens) == n_tokens:
        arr = group.create_array("token_text", shape=(n_tokens,), dtype=str, dimension_names=DIMENSIONS["token_text"],
                                 config=EVERY_CHUNK)
        arr[...] = np.asarray(tokens, dtype=str)
        names.append("token_text")
    return {"coordinates": " ".join(names)}


def consolidate(path: Path) -> None:
    """Consolidate a group's metadata into its zarr.json (read by ``xarray.open_zarr`` without a warning)."""
    import warnings

    import zarr

    with warnings.catch_warnings():  # zarr notes that consolidated metadata is not in the v3 spec (yet)
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path))


def shard_rows(row_block: int, n_rows: int, row_bytes: int, shard_bytes: int = SHARD_BYTES) -> int:
    """Rows per jacobian shard: whole row blocks, as many as fit in ``shard_bytes`` (at least one)."""
    blocks = max(1, shard_bytes // max(1, row_block * row_bytes))
    return min(row_block * blocks, -(-n_rows // row_block) * row_block)


def mismatches(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """Human-readable differences in the run identity, e.g. ``dtype: float32 (store) != float64``."""
    def get(run: dict[str, Any], key: str) -> Any:
        return run.get(key) or None if key in OPTIONAL_IDENTITY else run.get(key)

    return [f"{key}: {get(stored, key)!r} (store) != {get(wanted, key)!r}" for key in RUN_IDENTITY
            if get(stored, key) != get(wanted, key)]


# The keys of a run that say which model it ran (weights and tokenizer digests only where they were recorded).
MODEL_IDENTITY = ("model_type", "config_sha256", "weights_sha256", "tokenizer_sha256")


def model_differences(first: dict[str, Any], second: dict[str, Any], names: tuple[str, str]) -> list[str]:
    """Where two runs' models differ (``MODEL_IDENTITY`` keys both recorded), e.g.
    ``weights_sha256: 3f2a9c0d1e2b… (a.zarr) != 77aa01b2c3d4… (b.zarr)``; empty for the same model."""
    def short(value: Any) -> str:
        return f"{value[:12]}…" if isinstance(value, str) and len(value) == 64 else repr(value)

    return [f"{key}: {short(first[key])} ({names[0]}) != {short(second[key])} ({names[1]})" for key in MODEL_IDENTITY
            if first.get(key) is not None and second.get(key) is not None and first[key] != second[key]]


def read_root(path: Path) -> dict[str, Any]:
    """The store's root description; raises StoreFormatError for anything else."""
    meta_file = path / "zarr.json"
    if not path.exists():
        raise StoreFormatError(f"Expected a detjac store at {path}. Got no such file or folder.")
    if not path.is_dir() or not meta_file.is_file():
        raise StoreFormatError(f"Expected a detjac store (a zarr v3 folder with zarr.json) at {path}. "
                               f"Got {'a file' if path.is_file() else 'a folder without zarr.json'} instead.")
    try:
        meta = read_json(meta_file)
    except UnreadableJSONError as exc:
        raise StoreFormatError(f"Expected readable JSON in {meta_file}. Got {exc}.") from None
    except OSError as exc:
        raise StoreFormatError(f"Expected readable JSON in {meta_file}. Got an error: {exc}.") from exc
    attributes = meta.get("attributes", {}) if isinstance(meta, dict) else None
    if not isinstance(attributes, dict):
        raise StoreFormatError(f"Expected the metadata of a zarr group (a JSON object with an \"attributes\" object) "
                               f"in {meta_file}. Got {_kind(meta if attributes is None else attributes)}"
                               f"{'' if attributes is None else ' as its attributes'}.")
    root = attributes.get(ROOT_KEY)
    if meta.get("zarr_format") != 3 or not isinstance(root, dict):
        raise StoreFormatError(f"Expected a detjac store at {path}. Got a zarr folder without the "
                               f"'{ROOT_KEY}' attribute (not written by detjac).")
    version = root.get("format_version")
    if type(version) is not int or version < 1:
        raise StoreFormatError(f"Expected the store format version (a positive integer) in {meta_file}. Got "
                               f"{version!r}: the root attributes are damaged.")
    if version > FORMAT_VERSION:
        raise StoreFormatError(f"Expected store format version <= {FORMAT_VERSION} at {path}. Got {version!r}: "
                               "it was written by a newer detjac; upgrade detjac to read it.")
    if version < SEALED_SINCE and (INTEGRITY in root or (path / WRITER).exists()):
        raise StoreFormatError(f"Expected a store of format version {version} at {path}, as its root says. Got the "
                               f"contents of version {SEALED_SINCE} or later (a seal, the {WRITER} lock): the version "
                               "was changed, which would switch off the checks its contents call for.")
    if version >= SEALED_SINCE:
        seal = root.get(INTEGRITY)
        if not isinstance(seal, dict) or seal.get("attrs_sha256") != attrs_digest(root):
            raise StoreFormatError(f"Expected the root attributes of {path} to match the SHA-256 written with "
                                   f"them. Got {'no checksum' if not isinstance(seal, dict) else 'a different one'}: "
                                   "the store's run description was changed or damaged, so nothing in it is "
                                   "trusted.")
    return root


def _kind(value: Any) -> str:
    """A JSON value's kind, for messages: ``a list``, ``a number``, ..."""
    return {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number",
            dict: "an object"}.get(type(value), "null")


def sealed_root(run: dict[str, Any], model_sha256: dict[str, str],
                model_metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """The root description of a new store, with the SHA-256 of its own contents; ``model_metadata`` holds the
    SHA-256 of each model array's ``zarr.json`` (its values' digest says nothing of the shape or dtype they are
    read with)."""
    root = {"format_version": FORMAT_VERSION, "created": now(), "run": run, "model_sha256": model_sha256}
    if model_metadata is not None:
        root[MODEL_METADATA] = model_metadata
    return {**root, INTEGRITY: {"attrs_sha256": attrs_digest(root)}}


def non_standard_json(value: Any, where: str = "") -> str | None:
    """Where ``value`` holds what standard JSON cannot (NaN or an infinity, which Python's json writes as bare
    ``NaN`` / ``Infinity``), e.g. ``meta.score = nan``; None when it is all standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where or 'a value'} = {value}"
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for key, item in items:
        name = f"{where}{key}" if str(key).startswith("[") else f"{where}.{key}" if where else str(key)
        found = non_standard_json(item, name)
        if found:
            return found
    return None


def group_meta(attrs: dict[str, Any] | None = None) -> str:
    """The ``zarr.json`` text of a zarr v3 group with ``attrs``."""
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attrs or {}})


def ensure_group(folder: Path) -> None:
    """Make ``folder`` (whose parent exists) a zarr group, if it is not one yet."""
    folder.mkdir(exist_ok=True)
    meta = folder / "zarr.json"
    if not meta.is_file():
        meta.write_text(group_meta())
