"""GGUF checkpoints (llama.cpp's one-file format) as a model source: config, tokenizer and weights.

:func:`read_header` checks a file before anything is loaded; :class:`GGUFWeights` reads and dequantizes one tensor
(or row) at a time. Exact for the weights as dequantized, not for the model the file was quantized from. Details and
scope of exactness: docs/engine.md, "GGUF files"."""

from __future__ import annotations

import copy
import struct
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from detjac.errors import CheckpointError, UnsupportedModelError

from .quiet import quiet_tokenizer
from .weights import WeightSource, read_exact

GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"
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
    """What :func:`read_header` found: the scalar metadata (arrays only counted), the tensor table and where the
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


def is_gguf(source: Any) -> bool:
    """Whether ``source`` names a GGUF file: a path ending in ``.gguf``, or an existing file that starts with the
    GGUF magic bytes."""
    if not isinstance(source, str | Path):
        return False
    path = Path(source).expanduser()
    if path.suffix.lower() == GGUF_SUFFIX:
        return True
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def gguf_path(source: str | Path, gguf_file: str | None = None) -> Path:
    """The GGUF file that ``source`` (a file, or a folder holding ``gguf_file``) names, checked to exist.

    Raises
    ------
    CheckpointError
        The file does not exist, or ``gguf_file`` is not a plain file name inside the folder.
    """
    base = Path(source).expanduser()
    if gguf_file is not None:
        _check_file_name(gguf_file)
        if not base.is_dir():
            raise CheckpointError(f"Expected a folder (or hub id) holding {gguf_file} with --gguf-file. Got "
                                  f"{str(source)!r}, which is not a folder.")
        base = base / gguf_file
    if not base.is_file():
        found = sorted(p.name for p in base.parent.glob("*.gguf")) if base.parent.is_dir() else []
        raise CheckpointError(f"Expected a GGUF file at {base}. Got no such file"
                              + (f" (the folder holds {', '.join(found[:5])})." if found else "."))
    return base


def select_gguf(source: str | Path, gguf_file: str, revision: str | None = None) -> Path:
    """The GGUF file ``gguf_file`` inside the folder ``source``, or in the hub repository ``source`` (``org/name``:
    from the Hugging Face cache, else downloaded when online; see :mod:`detjac.engine.checkpoints.hub`).

    Raises
    ------
    CheckpointError
        No such file (the folder's GGUF files are named), or a hub file not in the cache while offline.
    """
    from .hub import is_hub_id, resolve_hub_file

    if is_hub_id(source):
        _check_file_name(gguf_file)
        return resolve_hub_file(str(source), gguf_file, revision)
    return gguf_path(source, gguf_file)


def _check_file_name(gguf_file: str) -> None:
    """Refuse a ``--gguf-file`` that is a path rather than a file name (it could reach outside the folder)."""
    if Path(gguf_file).name != gguf_file or gguf_file in ("", ".", ".."):
        raise CheckpointError(f"Expected --gguf-file to name a file inside the model folder (a plain file name "
                              f"such as model.Q4_K_M.gguf). Got {gguf_file!r}.")


def read_header(path: str | Path) -> GGUFHeader:
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
    """:func:`read_header`, remembered while the file's size and modification time are unchanged (commands read
    one header several times: config, tokenizer, weights, identity)."""
    try:
        with open(path, "rb") as f:
            header = _parse(f, path, size)
    except OSError as exc:
        raise CheckpointError(f"Expected a readable GGUF file at {path}. Got: {exc}") from None
    _check_types(header)
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
    alignment = int(metadata.get("general.alignment", 32))
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


def _as_blocks(raw: np.ndarray, tensor: GGUFTensor) -> np.ndarray:
    """Raw bytes of whole rows of ``tensor`` as the ``gguf`` package's dequantizer takes them: float types as bytes
    (it views them itself), quantized ones one row of blocks per line."""
    from gguf import GGMLQuantizationType

    if tensor.ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return raw
    return raw.reshape(-1, tensor.row_bytes())


class GGUFWeights(WeightSource):
    """The tensors of a GGUF file by the model's parameter names, dequantized one tensor (or row range) at a time.

    Parameters
    ----------
    path
        The GGUF file (checked by :func:`read_header`).
    model
        The model built from the file's config (on the meta device is enough): its parameter names are mapped to
        the file's tensors by transformers' GGUF name map.
    """

    def __init__(self, path: str | Path, model: nn.Module) -> None:
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self.path = Path(path)
        self.header = read_header(self.path)
        config = model.config.to_dict()
        self._processor = TENSOR_PROCESSORS.get(self.header.architecture, TensorProcessor)(config=config)
        to_model = get_gguf_hf_weights_map(_TopLevel(model), self._processor)
        self._by_model = {hf: gg for gg, hf in to_model.items() if gg in self.header.tensors}

    @classmethod
    def for_config(cls, path: str | Path, config: Any) -> GGUFWeights:
        """The weights of a GGUF file for a model built from ``config`` (built here on the meta device, for the
        names of its parameters only)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return cls(path, model)

    @property
    def packed(self) -> str | None:  # type: ignore[override]
        kinds = ", ".join(k for k in self.header.quantization_types() if k not in ("F32", "F16"))
        return f"gguf ({kinds})" if kinds else None

    def names(self) -> Any:
        return self._by_model.keys()

    def _tensor(self, name: str) -> GGUFTensor:
        try:
            return self.header.tensors[self._by_model[name]]
        except KeyError:
            raise CheckpointError(f"Expected tensor {name!r} in the GGUF file {self.path}. Got no such "
                                  "tensor.") from None

    def _rows(self, tensor: GGUFTensor, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of a tensor (all of a 1-D one), dequantized to float32 and fixed up."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if len(tensor.shape) > 1:
            row = tensor.nbytes // tensor.shape[0]
            begin, n = tensor.begin + start * row, (stop - start) * row
        else:
            begin, n, start, stop = tensor.begin, tensor.nbytes, 0, 1
        raw = np.frombuffer(read_exact(self.path, begin, n), dtype=np.uint8)
        shape = (stop - start, *tensor.shape[1:]) if len(tensor.shape) > 1 else tensor.shape
        values = dequantize(_as_blocks(raw, tensor), GGMLQuantizationType(tensor.ggml_type))
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        values = self._processor.process(weights=values, name=tensor.name).weights
        return torch.from_numpy(np.ascontiguousarray(values))

    def read(self, name: str) -> torch.Tensor:
        t = self._tensor(name)
        return self._rows(t, 0, t.shape[0] if len(t.shape) > 1 else 1)

    def read_rows(self, name: str, rows: list[int]) -> torch.Tensor:
        t = self._tensor(name)
        if len(t.shape) != 2:
            raise CheckpointError(f"Expected a 2-D tensor for {name!r}. Got shape {t.shape}.")
        parts = [self._rows(t, r, r + 1) for r in rows]
        return torch.cat(parts) if parts else torch.empty(0, t.shape[1])

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        t = self._tensor(name)
        return self._rows(t, start, stop)

    def nbytes(self, name: str) -> int:
        t = self._tensor(name)
        return int(np.prod(t.shape, dtype=np.int64)) * 4  # as read: float32


@dataclass(frozen=True)
class _TopLevel:
    """A model as transformers' GGUF name map sees it, without its submodules: the whole state dict's names are at
    the top already, and the map's walk into every submodule (for checkpoints converted from a base model) took
    seconds."""

    model: nn.Module

    @property
    def config(self) -> Any:
        return self.model.config

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def named_children(self) -> list[tuple[str, nn.Module]]:
        return []


def gguf_config(path: Path) -> Any:
    """The transformers config of a GGUF file (transformers' own GGUF config mapping), with its family checked.

    Raises
    ------
    CheckpointError
        A damaged file (see :func:`read_header`).
    UnsupportedModelError
        An architecture transformers cannot read from GGUF, or one detjac has no family for.
    """
    return copy.deepcopy(_config(path, *_stat(path)))


@lru_cache(maxsize=8)
def _config(path: Path, size: int, mtime_ns: int) -> Any:
    from transformers import AutoConfig

    from ..families import family_for

    header = _read_header(path, size, mtime_ns)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise UnsupportedModelError(f"Expected a GGUF of an architecture transformers can load. Got "
                                    f"{header.architecture!r} in {path}: {exc}") from None
    family_for(config)
    return config


def load_gguf_model(source: str | Path, *, dtype: torch.dtype, device: str | torch.device = "cpu") -> nn.Module:
    """A plain transformers model of a GGUF file's architecture, its weights dequantized to ``dtype`` (tied
    embeddings tied), in eval mode. Never transformers' packed GGUF model, which computes in float32.

    Raises
    ------
    CheckpointError
        A damaged file, or one whose tensors are not exactly the model's.
    UnsupportedModelError
        An architecture without a detjac family.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from .weights import check_complete

    path = gguf_path(source)
    config = gguf_config(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    weights = GGUFWeights(path, model)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    head = model.get_output_embeddings()
    head_name = next((n + ".weight" for n, m in model.named_modules() if m is head), None)
    check_complete(model, weights, f"a GGUF file {path}", optional={head_name} if tied else ())
    state = {name: weights.read(name).to(dtype=dtype) for name in weights.names()}
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    model.to(device)
    model.config.name_or_path = str(path)
    return model.eval()


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer transformers builds from the GGUF file's tokenizer metadata."""
    from transformers import AutoTokenizer

    read_header(path)
    return quiet_tokenizer(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
