"""Singular vectors of an operator, decoded to tokens through (un)embedding matrices."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from detjac import singular
from detjac.errors import CheckpointError
from detjac.singular import orient as orient_pairs


def numpy_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a tensor of ``dtype`` is copied to numpy in: its own, but float32 for 16-bit floats (numpy has
    no bfloat16; float16 is widened with it, so that both decode alike)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class RowBlocks:
    """A (rows, ...) matrix handed out in row blocks: ``m.shape``, ``m.dtype`` (numpy) and ``m[start:stop]`` (a numpy
    array), read on demand by ``read(start, stop)``, so that a vocabulary-sized matrix can be copied into a store
    without being held whole. A numpy array answers the same three."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, read: Callable[[int, int], torch.Tensor]) -> None:
        self.shape = tuple(int(s) for s in shape)
        self._torch_dtype = numpy_dtype(dtype)
        self.dtype = torch.empty(0, dtype=self._torch_dtype).numpy().dtype
        self._read = read

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"Expected a slice of rows start:stop. Got {index!r}.")
        start, stop, _ = index.indices(self.shape[0])
        rows = self._read(start, max(start, stop)).to(device="cpu", dtype=self._torch_dtype)
        expected = (max(0, stop - start), *self.shape[1:])
        if tuple(rows.shape) != expected:
            raise CheckpointError(f"Expected rows of shape {expected} from the weights. Got {tuple(rows.shape)}.")
        return rows.numpy()

    def __repr__(self) -> str:
        return f"RowBlocks(shape={self.shape}, dtype={self.dtype})"


@dataclass(frozen=True)
class SingularTriplets:
    """Top singular triplets ``op ~= U diag(S) V^T``: U (d_out, k), S (k,), V (d_in, k)."""

    U: torch.Tensor
    S: torch.Tensor
    V: torch.Tensor


def dense_svd(op: torch.Tensor, k: int, orient: torch.Tensor | None = None) -> SingularTriplets:
    """Exact top-``k`` SVD of a (d_out, d_in) operator.

    Singular vectors are defined up to a joint sign. With ``orient`` (d_out,) given, each
    pair is flipped so that ``u . orient >= 0`` (e.g. the output the operator produced),
    which makes decoded tokens comparable across runs. A 16-bit operator is decomposed in float32 (torch has no
    16-bit SVD on the CPU), and so are its triplets.
    """
    wide = numpy_dtype(op.dtype)
    op, orient = op.to(wide), (orient.to(wide) if orient is not None else None)
    U, S, Vh = torch.linalg.svd(op, full_matrices=False)
    U, S, V = U[:, :k], S[:k], Vh[:k].T
    if orient is not None:
        U, V = orient_pairs(U, V, orient)
    return SingularTriplets(U, S, V)


def decode_top(vectors: torch.Tensor, matrix: torch.Tensor | RowBlocks, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top token ids and scores of each column of ``vectors`` (d, k) through ``matrix`` (vocab, d), by
    :func:`detjac.singular.decode_top` (ties in vocabulary order).

    Returns (ids, scores), each (k, top), highest score first, as CPU tensors.
    """
    ids, scores = singular.decode_top(_numpy(vectors), _numpy(matrix), top)
    return torch.from_numpy(ids), torch.from_numpy(scores)


def decode_blocks(V: torch.Tensor, n_blocks: int, matrix: torch.Tensor | RowBlocks, top: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode right singular vectors of ``[J_1 ... J_n]`` (see :func:`detjac.singular.decode_blocks`).

    Returns (ids (k, top), scores (k, top), picks (k,) the chosen block, shares (k,) its share of ``|v|^2``).
    """
    return tuple(torch.from_numpy(a) for a in singular.decode_blocks(_numpy(V), n_blocks, _numpy(matrix), top))


def _numpy(t: torch.Tensor | RowBlocks | np.ndarray) -> Any:
    """A tensor as a numpy array on the CPU, in its own dtype (bfloat16 and float16 widened to float32); a
    :class:`RowBlocks` (rows read on demand) or a numpy array as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().to(device="cpu", dtype=numpy_dtype(t.dtype)).numpy()


def final_norm_gain(model: torch.nn.Module) -> torch.Tensor | None:
    """The final norm's elementwise gain (d,), ``offset + weight`` by the family's norm rule, or None.

    The final normed hidden state is ``x * s(x) * gain`` with ``s(x)`` a scalar per position,
    so ``W_U diag(gain)`` decodes an un-normed residual-stream vector (a layer's output) the
    way the model would, up to that positive scalar: the ranking of tokens is exact.
    """
    from ..detach.wrappers import DetachedNorm
    from ..families import family_for

    family = family_for(model.config)
    norm = getattr(family.decoder(model), "norm", None)
    if isinstance(norm, DetachedNorm):  # a linearized model
        norm, offset, center = norm.inner, norm.offset, norm.center
    else:
        rule = family.norm_rule(norm) if norm is not None else None
        if rule is None:
            return None
        offset, center = rule.weight_offset, rule.center
    if center or getattr(norm, "weight", None) is None:  # a LayerNorm's centring and bias are not a gain
        return None
    return norm.weight.detach() + offset


def model_decoding_matrices(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A loaded model's ``embedding`` (vocab, d), ``unembedding`` (vocab, d) (an encoder's word embeddings when it
    has no language-model head) and, where its final norm has one, ``final_norm`` (d,) gain; detached, on the CPU,
    in ``dtype`` (default: the model's). The one place a loaded model's decoding matrices are gathered."""
    from .logits import decoding_matrix

    arrays = {"embedding": model.get_input_embeddings().weight, "unembedding": decoding_matrix(model)}
    gain = final_norm_gain(model)
    if gain is not None:
        arrays["final_norm"] = gain
    return {k: v.detach().to(device="cpu", dtype=dtype or v.dtype) for k, v in arrays.items()}
