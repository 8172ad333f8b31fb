"""bitsandbytes-quantized weights as plain float tensors, decoded with bitsandbytes' own functions (bit for bit).

Scope of exactness: the Jacobian is that of the quantized model; 4-bit layers as bitsandbytes' plain dequantize path
computes them (not its AVX512-BF16 fast path), 8-bit ones as weight quantization only (not LLM.int8()'s rounding of
the activations). Details: docs/engine.md, "Quantized weights"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from detjac.errors import CheckpointError, DetjacError, InvalidArgumentError, UnsupportedModelError
from detjac.safe_json import parse_json

if TYPE_CHECKING:
    from types import ModuleType

QUANT_METHODS: tuple[str, ...] = ("nf4", "fp4", "int8")

_FOUR_BIT = ("nf4", "fp4")
# Suffixes (after "<param>.") of the tensors that carry a 4-bit weight's quantization state.
_QS_PACKED_PREFIX = "quant_state.bitsandbytes__"
_FOUR_BIT_AUX = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
# bitsandbytes' code for the only 8-bit weight layout it still reads ("row").
_INT8_ROW_FORMAT = 0
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _bitsandbytes(error: type[DetjacError], why: str) -> ModuleType:
    """Import ``bitsandbytes.functional``, turning a missing install into a detjac error."""
    try:
        import bitsandbytes.functional as bnbf
    except ImportError as e:
        raise error(
            f"Expected the optional package bitsandbytes, needed {why}. Got an import error ({e}). "
            "Install it with `pip install bitsandbytes`."
        ) from None
    return bnbf


def quantize_roundtrip(
    weight: torch.Tensor, method: str, *, blocksize: int = 64, double_quant: bool = False
) -> torch.Tensor:
    """The float weight a bitsandbytes layer computes with after quantizing ``weight`` on load.

    Quantizes with bitsandbytes' own functions and decodes the result, the way
    ``Linear4bit`` / ``Linear8bitLt`` do when transformers loads a float checkpoint with
    ``BitsAndBytesConfig(load_in_4bit=True)`` or ``load_in_8bit=True``.

    Parameters
    ----------
    weight : torch.Tensor
        A linear layer's weight, ``(out_features, in_features)``, on CPU or GPU, in
        ``float16``, ``bfloat16``, ``float32`` or ``float64``. ``float64`` is quantized from
        its ``float32`` rounding (bitsandbytes has no ``float64`` kernels), which is exact
        for weights that came from a 16- or 32-bit checkpoint.
    method : str
        One of :data:`QUANT_METHODS`: ``"nf4"`` or ``"fp4"`` (4-bit, blockwise absmax
        scaling) or ``"int8"`` (LLM.int8() row-wise absmax scaling of the ``float16`` weight).
    blocksize : int, optional
        4-bit block size (bitsandbytes accepts 32, 64, ..., 4096; transformers uses 64).
        Ignored for ``"int8"``.
    double_quant : bool, optional
        4-bit only: also quantize the block scales to 8 bits
        (``bnb_4bit_use_double_quant=True``), which changes the decoded weight. Ignored for
        ``"int8"``.

    Returns
    -------
    torch.Tensor
        The decoded weight, same shape, dtype and device as ``weight``. 4-bit values are the
        ``float32`` products bitsandbytes computes, rounded once to ``weight.dtype``.

    Raises
    ------
    InvalidArgumentError
        ``method`` is not in :data:`QUANT_METHODS`, ``weight`` is not a floating 2-D tensor,
        ``blocksize`` is not one bitsandbytes accepts, or bitsandbytes is not installed.
    """
    if method not in QUANT_METHODS:
        raise InvalidArgumentError(f"Expected a quantization method in {QUANT_METHODS}. Got {method!r}.")
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _FLOAT_DTYPES or weight.dim() != 2:
        got = f"a {weight.dim()}-D {weight.dtype} tensor" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise InvalidArgumentError(
            f"Expected a 2-D linear weight in one of {[str(d) for d in _FLOAT_DTYPES]} to quantize. Got {got}."
        )
    bnbf = _bitsandbytes(InvalidArgumentError, f"to quantize weights with method {method!r}")
    w = weight.detach()
    if method == "int8":
        # Int8Params quantizes the float16 copy of the weight, whatever its dtype.
        cb, scb, _ = bnbf.int8_vectorwise_quant(w.to(torch.float16).contiguous())
        return bnbf.int8_vectorwise_dequant(cb, scb).to(weight.dtype)
    if w.dtype == torch.float64:
        w = w.to(torch.float32)
    try:
        packed, state = bnbf.quantize_4bit(
            w.contiguous(), blocksize=blocksize, compress_statistics=double_quant, quant_type=method
        )
    except ValueError as e:
        raise InvalidArgumentError(f"Expected arguments bitsandbytes can quantize with. Got: {e}") from None
    state.dtype = torch.float32  # decode to the float32 products, then round once
    return bnbf.dequantize_4bit(packed, state).to(weight.dtype)


def dequantize_layer(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Plain float parameters from the raw tensors of a bitsandbytes-serialized checkpoint.

    Parameters
    ----------
    tensors : dict of str to torch.Tensor
        Tensors as read from the checkpoint's safetensors, with keys relative to one module
        tree (for example one decoder layer: ``self_attn.q_proj.weight``,
        ``self_attn.q_proj.weight.absmax``, ``input_layernorm.weight``, ...). All tensors of a
        quantized weight must be present together. Recognized layouts, per linear module ``m``:

        * 4-bit (``nf4``/``fp4``): ``m.weight`` (packed ``uint8``, or another storage dtype
          viewed as bytes), ``m.weight.absmax``, ``m.weight.quant_map`` and
          ``m.weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``: a JSON blob with shape,
          dtype and block size); with double quantization also
          ``m.weight.nested_absmax`` and ``m.weight.nested_quant_map``.
        * 8-bit (``int8``): ``m.weight`` (``int8``), ``m.SCB`` (``float32`` row scales) and
          optionally ``m.weight_format`` (must be ``0``, the row-major layout).
    dtype : torch.dtype
        The floating dtype of every returned tensor.

    Returns
    -------
    dict of str to torch.Tensor
        Each quantized ``m.weight`` decoded to ``dtype`` with the linear layer's original
        ``(out_features, in_features)`` shape; every other floating tensor (norm weights,
        biases, float linears) cast to ``dtype``; non-floating tensors unchanged; the
        auxiliary quantization keys dropped. 4-bit values are bitsandbytes' ``float32``
        products rounded once to ``dtype``; 8-bit values are ``int8 * SCB / 127``.

    Raises
    ------
    InvalidArgumentError
        ``dtype`` is not a floating dtype.
    CheckpointError
        A quantized weight's tensors are incomplete or inconsistent.
    UnsupportedModelError
        The tensors use a bitsandbytes layout this function does not decode (an unknown 4-bit
        type, a non-row 8-bit layout), or bitsandbytes is not installed.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidArgumentError(f"Expected a floating torch dtype to dequantize to. Got {dtype!r}.")
    four_bit, eight_bit = _quantized_params(tensors)
    consumed: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    if four_bit or eight_bit:
        bnbf = _bitsandbytes(UnsupportedModelError, "to read a checkpoint saved in bitsandbytes' quantized format")
        for param, aux in four_bit.items():
            out[param] = _decode_4bit(bnbf, param, tensors, aux).to(dtype)
            consumed.update(aux.values())
            consumed.add(param)
        for param, (scb_key, format_key) in eight_bit.items():
            out[param] = _decode_int8(bnbf, param, tensors, scb_key, format_key).to(dtype)
            consumed.update(k for k in (param, scb_key, format_key) if k is not None)
    for key, t in tensors.items():
        if key in consumed:
            continue
        if key.endswith(".weight_format"):  # layout tag of an 8-bit weight whose SCB is missing
            raise CheckpointError(f"Expected the row scales (SCB) of the 8-bit weight tagged by {key!r}. Got none.")
        if t.is_floating_point():
            out[key] = t.to(dtype)
        elif key.endswith("weight") and t.dtype in (torch.int8, torch.uint8):
            raise CheckpointError(
                f"Expected {key!r} to be a float weight or a quantized one with its bitsandbytes "
                f"state (absmax/quant_state for 4-bit, SCB for 8-bit). Got a bare {t.dtype} tensor."
            )
        else:
            out[key] = t
    return out


def _quantized_params(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, dict[str, str]], dict[str, tuple[str, str | None]]]:
    """Find the quantized weights among ``tensors``.

    Returns ``({param: {suffix: key}}, {param: (scb_key, weight_format_key or None)})`` for
    the 4-bit and 8-bit weights, where the 4-bit suffixes are the auxiliary keys' names
    after ``param + "."``.
    """
    four_bit: dict[str, dict[str, str]] = {}
    for key in tensors:
        head, sep, tail = key.rpartition("." + _QS_PACKED_PREFIX)
        if sep and tail and "." not in tail:
            four_bit[head] = {}
    for key in tensors:
        for suffix in (*_FOUR_BIT_AUX, _QS_PACKED_PREFIX):
            head, sep, tail = key.rpartition("." + suffix)
            if not sep or (suffix != _QS_PACKED_PREFIX and tail):
                continue
            if head not in four_bit:
                raise CheckpointError(
                    f"Expected the 4-bit weight {head!r} to come with its packed quant_state "
                    f"({head}.{_QS_PACKED_PREFIX}nf4 or ...fp4). Got {key!r} without it."
                )
            four_bit[head][suffix + tail] = key
            break
    eight_bit: dict[str, tuple[str, str | None]] = {}
    for key in tensors:
        if key == "SCB" or key.endswith(".SCB"):
            module = key[: -len("SCB")]  # "m." (or "m.weight." in older files)
            param = module[:-1] if module.endswith(".weight.") else module + "weight"
            fmt = module + "weight_format" if not module.endswith(".weight.") else module[:-1] + "_format"
            eight_bit[param] = (key, fmt if fmt in tensors else None)
    return four_bit, eight_bit


def _decode_4bit(bnbf: Any, param: str, tensors: dict[str, torch.Tensor], aux: dict[str, str]) -> torch.Tensor:
    """Decode one 4-bit weight to its float32 products."""
    if param not in tensors:
        raise CheckpointError(f"Expected the packed 4-bit weight {param!r} next to its quantization state. Got none.")
    for need in ("absmax", "quant_map"):
        if need not in aux:
            raise CheckpointError(f"Expected {param}.{need} for the 4-bit weight {param!r}. Got none.")
    if ("nested_absmax" in aux) != ("nested_quant_map" in aux):
        raise CheckpointError(
            f"Expected both nested_absmax and nested_quant_map (double quantization) for {param!r}, or neither. "
            f"Got only one."
        )
    packed_suffixes = [s for s in aux if s.startswith(_QS_PACKED_PREFIX)]
    if len(packed_suffixes) != 1:
        raise CheckpointError(
            f"Expected one packed quant_state for the 4-bit weight {param!r}. Got {sorted(packed_suffixes)}."
        )
    packed_suffix = packed_suffixes[0]
    quant_type = packed_suffix[len(_QS_PACKED_PREFIX):]
    if quant_type not in _FOUR_BIT:
        raise UnsupportedModelError(
            f"Expected a 4-bit weight quantized as one of {_FOUR_BIT}. Got {quant_type!r} for {param!r}."
        )
    blob = tensors[aux[packed_suffix]]
    try:
        meta = parse_json(bytes(blob.to(device="cpu", dtype=torch.uint8).reshape(-1).tolist()).decode("utf-8"))
        shape = torch.Size(int(n) for n in meta["shape"])
        blocksize = int(meta["blocksize"])
        nested = "nested_absmax" in aux
        if nested:
            nested_blocksize = int(meta["nested_blocksize"])
            offset = float(meta["nested_offset"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"Expected a JSON quant_state with shape, blocksize (and nested_* for double quantization) "
            f"in {aux[packed_suffix]!r}. Got an unreadable one ({type(e).__name__}: {e})."
        ) from None
    if meta.get("quant_type", quant_type) != quant_type:
        raise CheckpointError(
            f"Expected the quant_state of {param!r} to say {quant_type!r}, as its key does. Got {meta['quant_type']!r}."
        )
    weight = tensors[param]
    device = weight.device
    absmax = tensors[aux["absmax"]].to(device)
    state2 = None
    if nested:
        state2 = bnbf.QuantState(
            absmax=tensors[aux["nested_absmax"]].to(device),
            code=tensors[aux["nested_quant_map"]].to(device),
            blocksize=nested_blocksize,
            dtype=torch.float32,
        )
    state = bnbf.QuantState(
        absmax=absmax,
        shape=shape,
        code=tensors[aux["quant_map"]].to(device),
        blocksize=blocksize,
        quant_type=quant_type,
        dtype=torch.float32,  # the products bitsandbytes computes, before rounding to the compute dtype
        offset=torch.tensor(offset, dtype=torch.float32, device=device) if nested else None,
        state2=state2,
    )
    if weight.numel() * weight.element_size() * 2 < shape.numel():
        raise CheckpointError(
            f"Expected the packed 4-bit weight {param!r} to hold {shape.numel()} values (shape {list(shape)}). "
            f"Got {weight.numel() * weight.element_size()} bytes."
        )
    try:
        # A (n, 1) column is bitsandbytes' canonical packed layout (a leading 1 means transposed).
        decoded = bnbf.dequantize_4bit(weight.reshape(-1, 1), state)
    except (ValueError, RuntimeError) as e:
        raise CheckpointError(f"Expected bitsandbytes to decode the 4-bit weight {param!r}. Got: {e}") from None
    return decoded.reshape(shape)


def _decode_int8(
    bnbf: Any, param: str, tensors: dict[str, torch.Tensor], scb_key: str, format_key: str | None
) -> torch.Tensor:
    """Decode one LLM.int8() weight to ``int8 * SCB / 127`` in float32."""
    weight = tensors.get(param)
    if weight is None:
        raise CheckpointError(f"Expected the 8-bit weight {param!r} next to its row scales {scb_key!r}. Got none.")
    if format_key is not None:
        fmt = tensors[format_key]
        if fmt.numel() != 1 or int(fmt.reshape(-1)[0]) != _INT8_ROW_FORMAT:
            raise UnsupportedModelError(
                f"Expected the 8-bit weight {param!r} in bitsandbytes' row-major layout "
                f"(weight_format {_INT8_ROW_FORMAT}). Got weight_format {fmt.reshape(-1).tolist()}."
            )
    scb = tensors[scb_key]
    if weight.dtype != torch.int8 or weight.dim() != 2 or scb.shape != (weight.shape[0],):
        raise CheckpointError(
            f"Expected {param!r} to be a 2-D int8 weight with one row scale each in {scb_key!r}. Got a "
            f"{weight.dtype} weight of shape {list(weight.shape)} and scales of shape {list(scb.shape)}."
        )
    return bnbf.int8_vectorwise_dequant(weight, scb.to(device=weight.device, dtype=torch.float32))


def is_quantized_checkpoint(config: dict[str, Any]) -> str | None:
    """Which bitsandbytes format a checkpoint's ``config.json`` declares, if any.

    Parameters
    ----------
    config : dict
        The parsed ``config.json``.

    Returns
    -------
    str or None
        ``"nf4"`` or ``"fp4"`` for ``load_in_4bit`` (``bnb_4bit_quant_type``, default
        ``"fp4"`` as in transformers), ``"int8"`` for ``load_in_8bit``, ``None`` when the config
        has no ``quantization_config`` (or one that quantizes nothing).

    Raises
    ------
    UnsupportedModelError
        The checkpoint is quantized by another method (GPTQ, AWQ, FP8, ...) or declares a
        4-bit type other than nf4/fp4; loading it as float weights would be wrong.
    """
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedModelError(f"Expected quantization_config to be a JSON object. Got {type(qc).__name__}.")
    method = qc.get("quant_method", "bitsandbytes")
    if method != "bitsandbytes":
        raise UnsupportedModelError(
            f"Expected a float checkpoint or one quantized by bitsandbytes (quant_method 'bitsandbytes'). "
            f"Got quant_method {method!r}, which detjac cannot dequantize."
        )
    four = bool(qc.get("load_in_4bit", qc.get("_load_in_4bit", False)))
    eight = bool(qc.get("load_in_8bit", qc.get("_load_in_8bit", False)))
    if four and eight:
        raise UnsupportedModelError("Expected load_in_4bit or load_in_8bit in quantization_config. Got both.")
    if eight:
        return "int8"
    if four:
        qtype = qc.get("bnb_4bit_quant_type", "fp4")
        if qtype not in _FOUR_BIT:
            raise UnsupportedModelError(f"Expected bnb_4bit_quant_type in {_FOUR_BIT}. Got {qtype!r}.")
        return qtype
    return None
