"""Reading a GGUF file's header and tensor table (:func:`read_gguf_header`), checked before anything is built from it:
the magic and version, every metadata value's type and finiteness, the alignment, each tensor's byte range and
quantization type, and a tokenizer. Reads no tensor data; nothing here imports torch or transformers."""

from __future__ import annotations

import math
import struct
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from detjac.errors import CheckpointError
from detjac.model_names import GGUF_MAGIC

_VERSIONS = (2, 3)
# fixed-size metadata value types: id -> struct format (u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_TOKENIZER_KEY = "tokenizer.ggml.model"


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its name, torch-order shape, ggml type and absolute byte range."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    begin: int
    nbytes: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name

    def row_bytes(self) -> int:
        """Bytes of one row (the last dimension): a whole number of quantization blocks."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        return self.shape[-1] // block * size


@dataclass(frozen=True)
class GGUFHeader:
    """What :func:`read_gguf_header` found: the scalar metadata (arrays only counted), the tensor table and where the
    tensor data starts."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def quantization_types(self) -> dict[str, int]:
        """``{type name: number of tensors}``, e.g. ``{"F32": 61, "Q4_1": 210, "Q8_0": 1}``."""
        return dict(sorted(Counter(t.type_name for t in self.tensors.values()).items()))


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse and check a GGUF file's header and tensor table, reading no tensor data.

    Raises
    ------
    CheckpointError
        Not a GGUF file (its first bytes are named), an unsupported version, a header or tensor data that run past
        the end of the file (a truncated file), a quantization type the ``gguf`` package cannot dequantize (named,
        with the tensors that use it), or a file without a tokenizer.
    """
    path = Path(path)
    return _read_header(path, *_stat(path))


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError as exc:
        raise CheckpointError(f"Expected a readable GGUF file at {path}. Got: {exc}") from None
    return st.st_size, st.st_mtime_ns


@lru_cache(maxsize=8)
def _read_header(path: Path, size: int, mtime_ns: int) -> GGUFHeader:
    """:func:`read_gguf_header`, remembered while the file's size and modification time are unchanged (commands read
    one header several times: config, tokenizer, weights, identity)."""
    try:
        with open(path, "rb") as f:
            header = _parse(f, path, size)
    except CheckpointError:
        raise  # already says what is wrong (it is an OSError too: not to be wrapped again)
    except OSError as exc:
        raise CheckpointError(f"Expected a readable GGUF file at {path}. Got: {exc}") from None
    _check_types(header)
    _check_finite(header)
    if _TOKENIZER_KEY not in header.metadata:
        raise CheckpointError(f"Expected a tokenizer in the GGUF file {path} (metadata {_TOKENIZER_KEY} and "
                              "tokenizer.ggml.tokens). Got a file without one, so prompts cannot be turned into "
                              "tokens; use a GGUF converted with its tokenizer.")
    return header


class _Reader:
    """Little-endian reads from a file, with a clear error at the end of the file."""

    def __init__(self, f: Any, path: Path, size: int) -> None:
        self.f, self.path, self.size = f, path, size

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise CheckpointError(f"Expected a complete GGUF file at {self.path}. Got {self.size} bytes, which end "
                                  "inside its header (a truncated file?).")
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > self.size:
            raise CheckpointError(f"Expected a GGUF header in {self.path}. Got a string of {n} bytes in a "
                                  f"{self.size}-byte file (a damaged or truncated file?).")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS:  # skipped whole: only their count is kept
                width = struct.calcsize(_SCALARS[item])
                if count * width > self.size:
                    raise CheckpointError(f"Expected a GGUF header in {self.path}. Got an array of {count} values "
                                          f"in a {self.size}-byte file (a damaged or truncated file?).")
                self.take(count * width)
            else:
                for _ in range(count):
                    self.value(item)
            return _Count(count)
        raise CheckpointError(f"Expected a GGUF header in {self.path}. Got a metadata value of unknown type {kind} "
                              "(a damaged file, or a newer GGUF version).")


@dataclass(frozen=True)
class _Count:
    """An array value of the metadata, of which only the length is kept."""

    length: int


def _parse(f: Any, path: Path, size: int) -> GGUFHeader:
    r = _Reader(f, path, size)
    magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"Expected a GGUF file (it begins with the bytes {GGUF_MAGIC!r}) at {path}. Got one that "
                              f"begins with {magic!r}, so it is not a GGUF file.")
    version = r.unpack("<I")
    if version not in _VERSIONS:
        raise CheckpointError(f"Expected GGUF version {' or '.join(map(str, _VERSIONS))} in {path}. Got version "
                              f"{version}.")
    n_tensors, n_meta = r.unpack("<Q"), r.unpack("<Q")
    metadata = {}
    for _ in range(n_meta):
        key = r.string()
        metadata[key] = r.value(r.unpack("<I"))
    entries = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.unpack("<Q") for _ in range(r.unpack("<I"))]
        entries.append((name, tuple(reversed(dims)), r.unpack("<I"), r.unpack("<Q")))
    alignment = _alignment(metadata.get("general.alignment", 32), path)
    data_start = (f.tell() + alignment - 1) // alignment * alignment
    tensors = {}
    for name, shape, kind, offset in entries:
        nbytes = _nbytes(kind, shape, name, path)
        begin = data_start + offset
        if begin + nbytes > size:
            raise CheckpointError(f"Expected a complete GGUF file at {path}. Got {size} bytes, but tensor {name} "
                                  f"ends at byte {begin + nbytes} (a truncated file?).")
        tensors[name] = GGUFTensor(name, shape, kind, begin, nbytes)
    return GGUFHeader(path, version, metadata, tensors)


def _nbytes(kind: int, shape: tuple[int, ...], name: str, path: Path) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise CheckpointError(f"Expected tensors of a ggml type the gguf package knows in {path}. Got {name} of "
                              f"type id {kind}.") from None
    count = int(np.prod(shape, dtype=np.int64))
    if shape and shape[-1] % block:
        raise CheckpointError(f"Expected rows of whole quantization blocks in {path}. Got {name} with rows of "
                              f"{shape[-1]} values in blocks of {block}.")
    return count // block * size


def _check_types(header: GGUFHeader) -> None:
    """Refuse a quantization type the installed ``gguf`` package cannot dequantize, naming it."""
    from importlib.metadata import version

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    for kind in sorted({t.ggml_type for t in header.tensors.values()}):
        users = [t for t in header.tensors.values() if t.ggml_type == kind]
        qtype = GGMLQuantizationType(kind)
        try:  # one block of zeros: whether the package has a dequantizer for the type
            dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
        except NotImplementedError:
            names = ", ".join(t.name for t in users[:3]) + (" ..." if len(users) > 3 else "")
            raise CheckpointError(
                f"Expected tensors in quantization types the gguf package {version('gguf')} can dequantize in "
                f"{header.path}. Got {qtype.name} in {len(users)} tensors ({names})."
            ) from None




def _alignment(value: Any, path: Path) -> int:
    """``general.alignment``: a power of two (llama.cpp's rule), at most 2**20; CheckpointError otherwise."""
    if type(value) is not int or value < 1 or value & (value - 1) or value > 1 << 20:
        shown = f"an array of {value.length} values" if isinstance(value, _Count) else repr(value)
        raise CheckpointError(f"Expected general.alignment to be a power of two up to {1 << 20} in the GGUF file "
                              f"{path}. Got {shown}.")
    return value


def _check_finite(header: GGUFHeader) -> None:
    """Refuse a metadata number that is not finite (an epsilon, a rope base): it would make every output NaN."""
    for key, value in header.metadata.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise CheckpointError(f"Expected {key} to be a finite number in the GGUF file {header.path}. Got "
                                  f"{value}.")
