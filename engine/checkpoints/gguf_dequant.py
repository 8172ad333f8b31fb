"""GGUF tensors read and dequantized by the model's parameter names (:class:`GGUFWeights`): one tensor (or row
range) at a time, each checked to have the shape the model expects and finite values. Exact for the weights as
dequantized, not for the model the file was quantized from (docs/engine.md, "GGUF files"). The block types of
:mod:`~detjac.engine.checkpoints.gguf_blocks` are decoded there, in torch; any other type the ``gguf`` package
decodes, by its numpy decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from detjac.errors import CheckpointError

from .gguf_blocks import BLOCK_TYPES
from .gguf_blocks import dequantize as dequantize_blocks
from .gguf_header import GGUFTensor, read_gguf_header
from .gguf_names import model_tensor_names
from .stored import Packed
from .weights import WeightSource, read_exact


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
        The GGUF file (checked by :func:`read_gguf_header`).
    model
        The model built from the file's config (on the meta device is enough): its parameter names are mapped to
        the file's tensors by transformers' GGUF name map.
    """

    def __init__(self, path: str | Path, model: nn.Module) -> None:
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.path = Path(path)
        self.header = read_gguf_header(self.path)
        config = model.config.to_dict()
        self._processor = TENSOR_PROCESSORS.get(self.header.architecture, TensorProcessor)(config=config)
        self._by_model = model_tensor_names(model, self.header, self._processor)
        self._orders: dict[str, torch.Tensor | None | bool] = {}
        self._check_shapes(model)

    def _check_shapes(self, model: nn.Module) -> None:
        """Refuse a tensor whose shape is not its parameter's (names alone would let it reach a reshape)."""
        params = dict(model.named_parameters())
        for name, gg in self._by_model.items():
            want = tuple(params[name].shape) if name in params else None
            got = self.header.tensors[gg].shape
            if want is not None and int(np.prod(got, dtype=np.int64)) != int(np.prod(want, dtype=np.int64)):
                raise CheckpointError(f"Expected tensor {gg} of shape {want} (for {name}) in the GGUF file "
                                      f"{self.path}. Got shape {got}.")

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
        if tensor.type_name in BLOCK_TYPES:  # decoded in torch (gguf_blocks), equal to the gguf package's decoder
            values = dequantize_blocks(torch.from_numpy(raw.copy()), tensor.type_name, shape).numpy()
        else:  # a type only the gguf package decodes (on the CPU)
            values = dequantize(_as_blocks(raw, tensor), GGMLQuantizationType(tensor.ggml_type))
            values = np.asarray(values, dtype=np.float32).reshape(shape)
        values = self._processor.process(weights=values, name=tensor.name).weights
        if not np.isfinite(values).all():  # else reported much later as a Jacobian that does not reconstruct
            raise CheckpointError(f"Expected finite weights in tensor {tensor.name} of the GGUF file {self.path}. "
                                  "Got NaN or infinite values.")
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

    def read_stored(self, name: str, into: torch.Tensor | None = None) -> Any:
        """A matrix of a block type decoded in torch as its raw blocks (:class:`Packed`: dequantized where it is
        used, on that device); anything else (vectors, types only the ``gguf`` package decodes, a fix-up that is not
        a row order) as :meth:`read` gives it, float32."""
        t = self._tensor(name)
        order = self._row_order(t)
        if order is False:
            return self.read(name)
        raw = read_exact(self.path, t.begin, t.nbytes, into)
        raw = into if into is not None else torch.frombuffer(raw, dtype=torch.uint8)
        return Packed(raw.reshape(t.shape[0], -1), t.type_name, t.shape, t.name, order)

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """float32: every block type decodes to float32 values (the ``gguf`` package's and this decoder's)."""
        return torch.float32

    def stored_empty(self, name: str) -> torch.Tensor | None:
        t = self._tensor(name)
        return torch.empty(t.nbytes, dtype=torch.uint8) if self._row_order(t) is not False else None

    def stored_nbytes(self, name: str) -> int:
        t = self._tensor(name)
        return t.nbytes if self._row_order(t) is not False else self.nbytes(name)

    def _row_order(self, t: GGUFTensor) -> torch.Tensor | None | bool:
        """How transformers' fix-up of ``t`` reorders its rows: None (it leaves them), the order (rows,) int64, or
        False where ``t`` is not a matrix of a block type decoded in torch or the fix-up is not a row order
        (Gemma's ``1 + w`` norms). Found by running the fix-up on the row numbers."""
        if len(t.shape) != 2 or t.type_name not in BLOCK_TYPES or t.shape[0] >= 2**24 or t.nbytes == 0:
            return False
        if t.name not in self._orders:
            rows = np.arange(t.shape[0], dtype=np.float32).reshape(-1, 1)
            got = np.asarray(self._processor.process(weights=rows.copy(), name=t.name).weights)
            if got.shape != rows.shape or not np.array_equal(np.sort(got[:, 0]), rows[:, 0]):
                self._orders[t.name] = False
            elif np.array_equal(got, rows):
                self._orders[t.name] = None
            else:
                self._orders[t.name] = torch.from_numpy(got[:, 0].astype(np.int64))
        return self._orders[t.name]


