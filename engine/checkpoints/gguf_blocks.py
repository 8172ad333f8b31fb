"""GGUF quantization blocks decoded in torch, on whatever device the raw bytes are on.

Scope of exactness: for every block type in :data:`BLOCK_TYPES` (the float types F32, F16, BF16; the legacy Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0; the k-quants Q4_K, Q5_K, Q6_K), :func:`dequantize` gives the same float32 values, bit for
bit, as the ``gguf`` package's numpy dequantizer, which follows ggml's reference C code: the same products in the
same order, each rounded once in float32 (tests/engine/test_gguf_blocks.py checks every type on random blocks and
on the tensors of the two real GGUF files). Values are those of the weights *as quantized*; nothing is said about
the model the file was quantized from. A block type outside the table has no decoder here: :func:`check_block_type`
names it, and :class:`~detjac.engine.checkpoints.gguf_dequant.GGUFWeights` falls back to the ``gguf`` package's
numpy decoder on the CPU for it.

Because the decoder runs where the bytes are, a layer can travel and rest in its quantized form (a quarter of
bfloat16's bytes for 4-bit types) and be widened to the compute dtype only where it is used.

Layouts (one block; ``d``, ``m``, ``dmin`` are float16 scales, bytes little-endian):

========  =====  =====  ==========================================================================================
type      block  bytes  layout and value of weight ``i``
========  =====  =====  ==========================================================================================
Q4_0      32     18     d, qs[16]: nibble ``q`` (low nibbles are weights 0-15, high 16-31); ``d * (q - 8)``
Q4_1      32     20     d, m, qs[16]: ``d * q + m``
Q5_0      32     22     d, qh[4], qs[16]: ``q`` = nibble ``| bit i of qh << 4``; ``d * (q - 16)``
Q5_1      32     24     d, m, qh[4], qs[16]: ``d * q + m``
Q8_0      32     34     d, qs[32] int8: ``q * d``
Q4_K      256    144    d, dmin, scales[12] (eight 6-bit scales and mins), qs[128]: eight sub-blocks of 32,
                        ``(d * sc) * q - dmin * mn``; each 32-byte run of qs gives two sub-blocks (low, high)
Q5_K      256    176    as Q4_K with qh[32] before qs: sub-block ``j`` takes bit ``j`` of qh[l] as bit 4
Q6_K      256    210    ql[128], qh[64], scales[16] int8, d: ``(d * sc) * (q - 32)``, sixteen sub-blocks of 16
========  =====  =====  ==========================================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from detjac.errors import CheckpointError


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type: ``block`` weights in ``nbytes`` bytes, decoded by ``decode``: (n_blocks, nbytes) uint8
    -> (n_blocks, block) float32, on the input's device."""

    name: str
    block: int
    nbytes: int
    decode: Callable[[torch.Tensor], torch.Tensor]


def _half(raw: torch.Tensor) -> torch.Tensor:
    """(n, 2) little-endian float16 bytes -> (n, 1) float32 (exact): a block's scale, or an F16 tensor's values."""
    return raw.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """(n, k) bytes -> (n, 2k) 4-bit values: each run of ``run`` bytes gives its low nibbles, then its high ones."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 1, run)
    both = torch.cat([runs & 0x0F, runs >> 4], dim=2)  # (n, k / run, 2, run)
    return both.reshape(n, -1)


def _bits(qh: torch.Tensor, planes: int, run: int) -> torch.Tensor:
    """(n, run) bytes -> (n, planes * run): bit ``p`` of byte ``l`` at ``p * run + l`` (p < planes)."""
    shifts = torch.arange(planes, device=qh.device, dtype=torch.uint8).view(1, planes, 1)
    return ((qh.reshape(qh.shape[0], 1, run) >> shifts) & 1).reshape(qh.shape[0], -1)


def _f32(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float32)


def _bf16(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.bfloat16).to(torch.float32)


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    q = _nibbles(raw[:, 2:], 16).to(torch.int16) - 8
    return _half(raw[:, :2]) * q.to(torch.float32)


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    q = _nibbles(raw[:, 4:], 16).to(torch.float32)
    return _half(raw[:, :2]) * q + _half(raw[:, 2:4])


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 weights 0..31: a nibble of qs with bit ``i`` of the 32-bit qh as bit 4."""
    return (_nibbles(qs, 16) | (_bits(qh, 8, 4).reshape(qh.shape[0], 8, 4).transpose(1, 2).reshape(-1, 32) << 4))


def _q5_0(raw: torch.Tensor) -> torch.Tensor:
    q = _five_bit(raw[:, 2:6], raw[:, 6:]).to(torch.int16) - 16
    return _half(raw[:, :2]) * q.to(torch.float32)


def _q5_1(raw: torch.Tensor) -> torch.Tensor:
    q = _five_bit(raw[:, 4:8], raw[:, 8:]).to(torch.float32)
    return _half(raw[:, :2]) * q + _half(raw[:, 2:4])


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    q = raw[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q * _half(raw[:, :2])


def _scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 12) packed k-quant scales -> (n, 8) scales and (n, 8) mins, 6 bits each: the first four in the low six
    bits of bytes 0-3 (scales) and 4-7 (mins), the last four in the nibbles of bytes 8-11 with their top two bits
    in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    lo_sc, lo_mn, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 6) << 4)], dim=1)
    mn = torch.cat([lo_mn & 0x3F, (hi >> 4) | ((lo_mn >> 6) << 4)], dim=1)
    return sc, mn


def _k_affine(raw: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: ``(d * sc) * q - dmin * mn`` per sub-block of 32, from the 16-byte head (d, dmin, scales)."""
    n = raw.shape[0]
    sc, mn = _scales_mins(raw[:, 4:16])
    scale = (_half(raw[:, :2]) * sc.to(torch.float32)).reshape(n, 8, 1)
    shift = (_half(raw[:, 2:4]) * mn.to(torch.float32)).reshape(n, 8, 1)
    return (scale * q.to(torch.float32).reshape(n, 8, 32) - shift).reshape(n, 256)


def _q4_k(raw: torch.Tensor) -> torch.Tensor:
    return _k_affine(raw, _nibbles(raw[:, 16:144], 32))


def _q5_k(raw: torch.Tensor) -> torch.Tensor:
    q = _nibbles(raw[:, 48:176], 32) | (_bits(raw[:, 16:48], 8, 32) << 4)
    return _k_affine(raw, q)


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    n = raw.shape[0]
    low = _nibbles(raw[:, :128], 64)  # per half of 128 weights: ql[0:64] low nibbles, then their high nibbles
    shifts = torch.tensor([0, 2, 4, 6], device=raw.device, dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((raw[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 256)
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.float32)
    sc = raw[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    scale = (_half(raw[:, 208:210]) * sc).reshape(n, 16, 1)
    return (scale * q.reshape(n, 16, 16)).reshape(n, 256)


BLOCK_TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("F32", 1, 4, _f32), BlockType("F16", 1, 2, _half), BlockType("BF16", 1, 2, _bf16),
    BlockType("Q4_0", 32, 18, _q4_0), BlockType("Q4_1", 32, 20, _q4_1), BlockType("Q5_0", 32, 22, _q5_0),
    BlockType("Q5_1", 32, 24, _q5_1), BlockType("Q8_0", 32, 34, _q8_0), BlockType("Q4_K", 256, 144, _q4_k),
    BlockType("Q5_K", 256, 176, _q5_k), BlockType("Q6_K", 256, 210, _q6_k),
)}
"""The block types decoded here, by their ggml names."""


def check_block_type(name: str) -> BlockType:
    """The :class:`BlockType` called ``name``.

    Raises
    ------
    CheckpointError
        A block type without a decoder here, naming the ones there are.
    """
    try:
        return BLOCK_TYPES[name]
    except KeyError:
        raise CheckpointError(f"Expected a GGUF block type detjac decodes ({', '.join(BLOCK_TYPES)}). "
                              f"Got {name}.") from None


def dequantize(raw: torch.Tensor, name: str, shape: Sequence[int]) -> torch.Tensor:
    """The float32 values of a GGUF tensor (or of whole rows of one) from its raw bytes.

    Parameters
    ----------
    raw
        (nbytes,) or (n_blocks, block bytes) uint8: the bytes as stored in the file, on any device.
    name
        The block type's ggml name (``"Q4_K"``, ...).
    shape
        The values' shape (torch order: rows first); its last dimension holds whole blocks.

    Returns
    -------
    torch.Tensor
        ``shape`` float32, on ``raw``'s device, equal bit for bit to the ``gguf`` package's numpy dequantizer.

    Raises
    ------
    CheckpointError
        An unknown block type, bytes that are not uint8, or a byte count that does not hold ``shape``.
    """
    kind = check_block_type(name)
    count = 1
    for s in shape:
        count *= int(s)
    if raw.dtype != torch.uint8:
        raise CheckpointError(f"Expected the raw bytes of a GGUF tensor as uint8. Got {raw.dtype}.")
    want = count // kind.block * kind.nbytes
    if (shape and int(shape[-1]) % kind.block) or raw.numel() != want:
        raise CheckpointError(f"Expected {want} bytes of whole {name} blocks of {kind.block} values for shape "
                              f"{tuple(shape)}. Got {raw.numel()} bytes.")
    values = kind.decode(raw.reshape(-1, kind.nbytes))
    return values.reshape(tuple(int(s) for s in shape))
