"""Where the layer-streamed engine gets its weights: a loaded model, or safetensors on disk (GGUF files:
:mod:`detjac.engine.checkpoints.gguf`; which source a model gets: :mod:`detjac.engine.checkpoints.sources`).

One module subtree at a time, by positioned reads (no memory map, nothing unpickled), dequantized or quantized on the
way. Details: docs/engine.md, "Model sources"."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from detjac.errors import CheckpointError
from detjac.safe_json import parse_json

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}

# Multimodal checkpoints hold other towers whose layers have the same tail names as the text decoder's.
_OTHER_TOWERS = ("vision", "multi_modal", "audio")


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a header


def _read_header(path: Path) -> dict[str, _Entry]:
    """Tensor table of one safetensors file (8-byte little-endian header size, JSON header, data), checked against
    the file before any tensor is read: a well-formed entry per tensor (dtype, shape, offsets whose span is the
    shape's bytes) and data that ends where the file ends (a truncated or padded file is refused)."""
    try:
        size_on_disk = path.stat().st_size
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > min(MAX_HEADER_BYTES, size_on_disk - 8):
                raise ValueError(f"a header of {size} bytes in a file of {size_on_disk}")
            header = parse_json(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointError(f"Expected a readable safetensors file at {path}. Got: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"Expected a safetensors header (a JSON object) in {path}. Got {type(header).__name__}.")
    table: dict[str, _Entry] = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry = _header_entry(path, name, info, 8 + size)
        table[name] = entry
        data_end = max(data_end, entry.end)
    if data_end and data_end != size_on_disk:
        raise CheckpointError(
            f"Expected {path} to hold {data_end} bytes (its header's tensors end there). Got {size_on_disk}: the file "
            f"is {'truncated' if size_on_disk < data_end else 'longer than its tensors'} (an interrupted download or "
            "copy?). Fetch it again.")
    return table


def _header_entry(path: Path, name: str, info: Any, base: int) -> _Entry:
    """One tensor's entry of a safetensors header, checked: dtype known, shape of non-negative ints, offsets that
    span exactly the shape's bytes."""
    try:
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        valid = (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
                 and type(begin) is int and type(end) is int and 0 <= begin <= end)
    except (TypeError, KeyError, ValueError):
        valid = False
    if not valid:
        raise CheckpointError(f"Expected a tensor entry (dtype, shape, data_offsets) for {name} in {path}. Got "
                              f"{str(info)[:120]}.")
    if dtype not in _SAFETENSORS_DTYPES:
        raise CheckpointError(f"Expected tensors of a supported dtype in {path}. Got {name} as {dtype}.")
    torch_dtype = _SAFETENSORS_DTYPES[dtype]
    numel = 1
    for n in shape:
        numel *= n
    if end - begin != numel * torch_dtype.itemsize:
        raise CheckpointError(f"Expected {name} in {path} to span {numel * torch_dtype.itemsize} bytes (shape "
                              f"{tuple(shape)}, {dtype}). Got offsets {begin}..{end}: a damaged header.")
    return _Entry(path, torch_dtype, tuple(shape), base + begin, base + end)


def safetensors_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a folder's safetensors shards, from their (checked) headers; nothing is read beyond
    the headers."""
    return {name: e.shape for f in sorted(folder.glob("*.safetensors")) for name, e in _read_header(f).items()}


class WeightSource:
    """Tensors of a model by name; subclasses say where they come from."""

    quantized: str | None = None  # a bitsandbytes checkpoint's method: its layers are dequantized as they are read
    packed: str | None = None  # a checkpoint of another quantized format, read as floats already (e.g. gguf)

    def names(self) -> Iterable[str]:
        raise NotImplementedError

    def read(self, name: str) -> torch.Tensor:
        """The tensor as stored (storage dtype, CPU, or the loaded model's device)."""
        raise NotImplementedError

    def read_rows(self, name: str, rows: list[int]) -> torch.Tensor:
        """Rows ``rows`` of a 2-D tensor, in order."""
        return self.read(name)[rows]

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of a 2-D tensor."""
        return self.read(name)[start:stop]

    def nbytes(self, name: str) -> int:
        raise NotImplementedError

    def read_stored(self, name: str, into: torch.Tensor | None = None) -> Any:
        """The tensor in its stored form (a float tensor in its stored dtype, or a GGUF tensor's raw blocks: a
        :class:`~detjac.engine.checkpoints.stored.Packed`), for :func:`~detjac.engine.checkpoints.stored.widen` where
        it is used; ``into``: a buffer from :meth:`stored_empty` the read fills."""
        return self.read(name)

    def stored_empty(self, name: str) -> torch.Tensor | None:
        """An uninitialized CPU buffer for :meth:`read_stored` to fill (None: the read makes its own)."""
        return None

    def stored_nbytes(self, name: str) -> int:
        """Bytes of the tensor in its stored form."""
        return self.nbytes(name)

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """The dtype the tensor is stored in, where the source can say without reading it (None: it decodes the
        tensor itself, e.g. a GGUF's blocks, or a bitsandbytes checkpoint's)."""
        return None

    def resolve(self, name: str) -> str:
        """The source's key for the model's parameter ``name`` (see :func:`resolve_key`)."""
        return name

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The stored shape of the tensor ``name`` (a key of :meth:`names`), None where the source cannot say
        without reading it or stores it packed (quantized)."""
        return None


class ModuleWeights(WeightSource):
    """The parameters of an already-loaded model (no copy when dtype and device match)."""

    def __init__(self, model: nn.Module) -> None:
        self._tensors = {**dict(model.named_parameters(remove_duplicate=False)),
                         **dict(model.named_buffers(remove_duplicate=False))}

    def names(self) -> Iterable[str]:
        return self._tensors.keys()

    def read(self, name: str) -> torch.Tensor:
        return self._tensors[name].detach()

    def nbytes(self, name: str) -> int:
        t = self._tensors[name]
        return t.numel() * t.element_size()

    def stored_dtype(self, name: str) -> torch.dtype | None:
        return self._tensors[name].dtype


class SafetensorsWeights(WeightSource):
    """The tensors of a checkpoint folder's ``*.safetensors`` shards, read one at a time."""

    def __init__(self, folder: str | Path, config: dict[str, Any] | None = None) -> None:
        folder = Path(folder)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"Expected *.safetensors weights in {folder} for the layer-streamed engine. Got none "
                "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))."
            )
        self._table: dict[str, _Entry] = {}
        for f in files:
            self._table.update(_read_header(f))
        self._resolved: dict[str, str] = {}
        if (config or {}).get("quantization_config") is not None:
            from .quantized import is_quantized_checkpoint

            self.quantized = is_quantized_checkpoint(config or {})

    def names(self) -> Iterable[str]:
        return self._table.keys()

    def _entry(self, name: str) -> _Entry:
        try:
            return self._table[name]
        except KeyError:
            raise CheckpointError(f"Expected tensor {name!r} in the checkpoint. Got no such tensor.") from None

    def read(self, name: str) -> torch.Tensor:
        e = self._entry(name)
        return self._read_bytes(e, e.begin, e.end).reshape(e.shape)

    def read_stored(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        if into is None:
            return self.read(name)
        e = self._entry(name)
        read_exact(e.file, e.begin, e.end - e.begin, into.view(torch.uint8).reshape(-1))
        return into

    def stored_dtype(self, name: str) -> torch.dtype | None:
        return None if self.quantized else self._entry(name).dtype

    def stored_empty(self, name: str) -> torch.Tensor | None:
        e = self._entry(name)
        return torch.empty(e.shape, dtype=e.dtype) if not self.quantized and e.end > e.begin else None

    def read_rows(self, name: str, rows: list[int]) -> torch.Tensor:
        e = self._entry(name)
        if len(e.shape) != 2:
            raise CheckpointError(f"Expected a 2-D tensor for {name!r}. Got shape {e.shape}.")
        row_bytes = e.shape[1] * e.dtype.itemsize
        parts = [self._read_bytes(e, e.begin + r * row_bytes, e.begin + (r + 1) * row_bytes) for r in rows]
        return torch.stack(parts) if parts else torch.empty(0, e.shape[1], dtype=e.dtype)

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        e = self._entry(name)
        row_bytes = e.shape[1] * e.dtype.itemsize
        return self._read_bytes(e, e.begin + start * row_bytes, e.begin + stop * row_bytes).reshape(-1, e.shape[1])

    @staticmethod
    def _read_bytes(e: _Entry, begin: int, end: int) -> torch.Tensor:
        buf = read_exact(e.file, begin, end - begin)
        if not buf:
            return torch.empty(0, dtype=e.dtype)
        return torch.frombuffer(buf, dtype=e.dtype)

    def nbytes(self, name: str) -> int:
        e = self._entry(name)
        return e.end - e.begin

    def shape(self, name: str) -> tuple[int, ...] | None:
        return None if self.quantized else self._entry(name).shape

    def resolve(self, name: str) -> str:
        if name not in self._resolved:
            self._resolved[name] = resolve_key(name, self._table)
        return self._resolved[name]


def read_exact(file: Path, begin: int, n: int, into: torch.Tensor | None = None) -> Any:
    """``n`` bytes of ``file`` from byte ``begin``, by a positioned read (no memory map, so the file's pages are not
    left counted in the process's resident memory); into ``into`` (a contiguous CPU uint8 tensor of ``n``) where given.

    Raises
    ------
    CheckpointError
        The file ends before them (a truncated file).
    """
    buf: Any = bytearray(n) if into is None else memoryview(into.numpy()).cast("B")
    with open(file, "rb", buffering=0) as f:
        f.seek(begin)
        got = f.readinto(buf)
    if got != n:
        raise CheckpointError(f"Expected {n} bytes from {file}. Got {got} (truncated file?).")
    return buf


def resolve_key(name: str, keys: Iterable[str]) -> str:
    """The checkpoint key holding the model parameter ``name``.

    The same name when present; otherwise the one key that ends with the same
    ``layers.N...`` (or ``embed_tokens...``, ``norm...``) tail outside other modalities'
    towers: released multimodal checkpoints (Gemma3) nest the text decoder differently
    from the module tree transformers builds.
    """
    keys = keys if isinstance(keys, dict) else dict.fromkeys(keys)
    if name in keys:
        return name
    parts = name.split(".")
    anchor = next((i for i, p in enumerate(parts) if p in ("layers", "embed_tokens", "norm", "lm_head")), 0)
    tail = ".".join(parts[anchor:])
    hits = [k for k in keys if (k == tail or k.endswith("." + tail)) and not any(t in k for t in _OTHER_TOWERS)]
    if len(hits) == 1:
        return hits[0]
    raise CheckpointError(
        f"Expected one checkpoint tensor for the model's parameter {name!r}. Got "
        + (f"several candidates: {', '.join(sorted(hits)[:4])}." if hits else "none (a checkpoint of another model?).")
    )


def check_complete(model: nn.Module, source: WeightSource, where: str = "a checkpoint",
                   optional: Iterable[str] = (), required: tuple[str, ...] = ("",)) -> None:
    """Refuse a checkpoint that lacks one of ``model``'s parameters or holds a tensor the model has no place for.

    Either would otherwise surface mid-run (a missing tensor) or never (an extra one: a checkpoint of
    another architecture). Only parameters whose names start with one of ``required`` must be there, and
    ``optional`` ones may be missing (a tied unembedding, read from the embedding); other modalities'
    towers and the auxiliary tensors of a bitsandbytes checkpoint (next to the weight they quantize)
    are expected.

    Raises
    ------
    CheckpointError
        Naming the missing and the unexpected tensors (the first few of each).
    """
    if is_resident(source):
        return
    keys = dict.fromkeys(source.names())
    used: set[str] = set()
    missing = []
    for name, _ in model.named_parameters():
        try:
            used.add(resolve_key(name, keys))
        except CheckpointError:
            if name not in optional and name.startswith(required):
                missing.append(name)
    for name, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        try:
            used.add(resolve_key(name, keys))
        except CheckpointError:
            pass
    modules = {k.rsplit(".", 1)[0] for k in used} if source.quantized else set()
    unexpected = [k for k in keys if k not in used and not any(t in k for t in _OTHER_TOWERS)
                  and not any(k.startswith(m + ".") for m in modules)]
    if missing or unexpected:
        raise tensors_error(where, {"missing": missing, "unexpected": unexpected})


def check_shapes(model: nn.Module, source: WeightSource, where: str = "a checkpoint") -> None:
    """Refuse a checkpoint whose tensors do not have the shapes the config gives the model's parameters (``model``
    may be on the meta device: nothing is allocated or read beyond the headers). Parameters the source does not
    hold, or holds packed, are left to :func:`check_complete` and the loader.

    Raises
    ------
    CheckpointError
        Naming each mismatched tensor with both shapes (the first five).
    """
    if is_resident(source):
        return
    keys = dict.fromkeys(source.names())
    wrong = []
    for name, param in model.named_parameters():
        if name not in keys and any(t in name for t in _OTHER_TOWERS):
            continue  # another modality's tower: its tail names are the text decoder's (resolve_key skips them)
        try:
            key = resolve_key(name, keys)
        except CheckpointError:
            continue
        stored = source.shape(key)
        if stored is not None and tuple(stored) != tuple(param.shape):
            wrong.append(f"{key} {tuple(stored)} (checkpoint) != {tuple(param.shape)} (config)")
    if wrong:
        raise tensors_error(where, {"of another shape": wrong})


def tensors_error(where: str, found: dict[str, list[str]]) -> CheckpointError:
    """The error for a checkpoint whose tensors are not the model's: ``found`` maps "missing", "unexpected"
    (...) to tensor names; the first five of each are named."""
    return CheckpointError(f"Expected {where} with exactly the model's tensors. Got " + "; ".join(
        f"{len(names)} {what}: {', '.join(sorted(names)[:5])}{' ...' if len(names) > 5 else ''}"
        for what, names in found.items() if names) + ".")


def is_resident(source: WeightSource) -> bool:
    """Whether the source's tensors already live in memory (a loaded model)."""
    return isinstance(source, ModuleWeights)
