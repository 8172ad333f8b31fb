"""A weight in the form it is stored in, and its widening to the compute dtype where it is used.

The layer-streamed engine reads, holds, reads ahead and copies each layer in its stored form: a safetensors tensor in
its stored dtype (bfloat16, float16, float32), or a GGUF tensor's raw quantized blocks (:class:`Packed`). Only where a
sweep uses a layer is it widened (:func:`widen`) to the compute dtype, on the compute device. Scope of exactness: a
widened float tensor is the stored values cast once to the compute dtype, exact for every float dtype at least as wide;
a widened :class:`Packed` tensor is the :mod:`~detjac.engine.checkpoints.gguf_blocks` decoder's float32 values (bit for
bit the ``gguf`` package's) cast once, so the float64 Jacobian is exact for the model as dequantized. Nothing here
changes the values; where a row fix-up applies (llama.cpp's Q/K row order) it is applied to whole rows of blocks.
Details: docs/engine.md, "Stored dtype"."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from detjac.errors import CheckpointError, InvalidArgumentError

# stored float dtypes the engine widens (a narrower compute dtype than the stored one is refused where exactness is
# asked: check_compute_dtype)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Packed:
    """One GGUF tensor as stored: ``raw`` (rows, row bytes) uint8, its block type, its torch-order ``shape``, and
    ``order`` (rows,) int64 where the model's row ``r`` is stored row ``order[r]`` (None: as stored)."""

    raw: torch.Tensor
    type_name: str
    shape: tuple[int, ...]
    name: str = ""
    order: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.raw.dtype

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def numel(self) -> int:
        return self.raw.numel()

    def element_size(self) -> int:
        return 1

    def pin_memory(self) -> Packed:
        return replace(self, raw=self.raw.pin_memory())

    def to(self, device: Any = None, non_blocking: bool = False) -> Packed:
        order = None if self.order is None else self.order.to(device, non_blocking=non_blocking)
        return replace(self, raw=self.raw.to(device, non_blocking=non_blocking), order=order)

    def record_stream(self, stream: Any) -> None:
        self.raw.record_stream(stream)


Stored = torch.Tensor | Packed


def stored_bytes(t: Stored) -> int:
    """Bytes a stored tensor takes (its raw blocks for a :class:`Packed` one)."""
    return t.numel() * t.element_size()


def widen(t: Stored, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``t`` in the compute ``dtype`` on ``device``: moved there in its stored form first, then converted there.

    Raises
    ------
    CheckpointError
        A packed tensor whose values are not finite (else reported much later as a Jacobian that does not
        reconstruct).
    CheckpointError
        A stored dtype that is not a float dtype the engine converts.
    """
    if isinstance(t, Packed):
        return _widen_packed(t.to(device), dtype)
    check_stored_dtype(t.dtype)
    return t.to(device=device).to(dtype)


# a packed tensor is decoded this many bytes of float32 rows at a time into its widened tensor: the decoder's
# transients (unpacked quants, scales, float32 values) are a chunk's, not the whole matrix's
DECODE_CHUNK_BYTES = 16 * 2**20


def _widen_packed(p: Packed, dtype: torch.dtype) -> torch.Tensor:
    """The float32 values of ``p``'s blocks (its rows in the model's order), checked finite, in ``dtype``: a chunk of
    rows at a time (:data:`DECODE_CHUNK_BYTES`) into the widened tensor."""
    from .gguf_blocks import dequantize

    rows, row_values = int(p.shape[0]), int(torch.Size(p.shape[1:]).numel())
    by_rows = len(p.shape) >= 2 and p.raw.dim() == 2 and int(p.raw.shape[0]) == rows
    step = rows if not by_rows else max(1, DECODE_CHUNK_BYTES // (4 * max(1, row_values)))
    out = None if step >= rows else torch.empty(p.shape, dtype=dtype, device=p.raw.device)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        raw = p.raw[start:stop] if p.order is None else p.raw.index_select(0, p.order[start:stop])
        values = dequantize(raw.reshape(-1), p.type_name, (stop - start, *p.shape[1:]))
        if not bool(torch.isfinite(values).all()):
            raise CheckpointError(f"Expected finite weights in tensor {p.name or '?'} of the GGUF file. Got NaN or "
                                  "infinite values.")
        if out is None:
            return values.to(dtype)
        out[start:stop] = values
    assert out is not None
    return out


def check_stored_dtype(dtype: torch.dtype, name: str = "a weight") -> None:
    """Refuse a stored dtype the engine cannot widen to a float compute dtype.

    Raises
    ------
    CheckpointError
        Naming the tensor, its dtype and what is converted.
    """
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"Expected {name} stored as float16, bfloat16, float32 or float64 (a dtype the "
                                   f"engine converts to the compute dtype). Got {dtype}.")


def check_compute_dtype(stored: set[torch.dtype], compute: torch.dtype, exact: bool) -> None:
    """Refuse, where exactness is asked (``exact``), a compute dtype that cannot hold every stored weight as it is
    (narrower, or as wide in the other format: float16 against bfloat16): the weights would be rounded before the
    Jacobian is taken. ``stored``: the stored float dtypes.

    Raises
    ------
    InvalidArgumentError
        One line: what was expected, what was got.
    """
    if not exact:
        return
    for dtype in sorted(stored, key=lambda t: -torch.finfo(t).bits):
        fits = torch.finfo(compute).bits > torch.finfo(dtype).bits or compute == dtype
        if not fits:
            raise InvalidArgumentError(f"Expected --dtype at least as precise as the weights as stored ({dtype}) for "
                                       f"an exact Jacobian. Got {compute}.")
