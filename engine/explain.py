"""Singular triplets of a detached Jacobian, per token and combined, decoded to tokens.

Left singular vectors live in the output (hidden) space and are decoded through the
unembedding; the Jacobian's output is the final *normed* hidden state, so no further norm
scale applies. Right singular vectors live in the input-embedding space and are decoded
through the input embedding matrix. Signs are fixed so that each left vector points along
the part of the output its operator produced (``u . J x >= 0``): a decoded token then reads
as "pushed towards", not "pushed towards or away from".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .decode import SingularTriplets, decode_blocks, decode_top, dense_svd, model_decoding_matrices
from .jacobian import JacobianResult


@dataclass(frozen=True)
class DecodedOperator:
    """Top singular triplets of one operator with their decoded tokens.

    Attributes
    ----------
    label : str
        ``"combined"`` or the token's text.
    position : int | None
        Token index for a per-token operator ``J_k``; None for the combined ``[J_1 ... J_n]``.
    spectrum : torch.Tensor
        (min(rows, cols),) all singular values, descending.
    left_ids, left_scores : torch.Tensor
        (k, top) tokens that ``W_U u_i`` ranks highest, with their scores.
    right_ids, right_scores : torch.Tensor
        (k, top) tokens that ``W_E v_i`` ranks highest (for the combined operator: the
        ``d_model`` block of ``v_i`` at ``right_positions[i]``).
    right_positions : list[int]
        Token index whose block carries the most of ``|v_i|^2`` (per-token: always ``position``).
    right_shares : list[float]
        That block's share of ``|v_i|^2`` (1.0 for a per-token operator).
    """

    label: str
    position: int | None
    spectrum: torch.Tensor
    left_ids: torch.Tensor
    left_scores: torch.Tensor
    right_ids: torch.Tensor
    right_scores: torch.Tensor
    right_positions: list[int]
    right_shares: list[float]

    @property
    def singular_values(self) -> torch.Tensor:
        """(k,) the top singular values that were decoded."""
        return self.spectrum[: self.left_ids.shape[0]]


@dataclass(frozen=True)
class Explanation:
    """A Jacobian result with its combined and per-token decoded operators."""

    result: JacobianResult
    combined: DecodedOperator
    per_token: list[DecodedOperator]


def _decode(op: torch.Tensor, produced: torch.Tensor, n_blocks: int, unembed: torch.Tensor, embed: torch.Tensor,
            k: int, top: int) -> tuple[torch.Tensor, ...]:
    """Decode the top ``k`` triplets of ``op`` (d, n_blocks * d); returns tensors and block picks."""
    full = dense_svd(op, min(op.shape), orient=produced)  # one SVD: the spectrum and the top k
    spectrum = full.S
    svd = SingularTriplets(full.U[:, :k], full.S[:k], full.V[:, :k])
    left_ids, left_scores = decode_top(svd.U, unembed, top)
    right_ids, right_scores, picks, shares = decode_blocks(svd.V, n_blocks, embed, top)
    return spectrum, left_ids, left_scores, right_ids, right_scores, picks, shares


def explain(result: JacobianResult, model: torch.nn.Module, k: int = 5, top: int = 5,
            tokens: list[str] | None = None) -> Explanation:
    """Decode the top ``k`` singular triplets of ``[J_1 ... J_n]`` and of every ``J_k``.

    Parameters
    ----------
    result : JacobianResult
        From :func:`detached_jacobian` with ``target="hidden"``.
    model : torch.nn.Module
        The model the result came from (its input and output embedding matrices are used).
    k : int
        Triplets per operator.
    top : int
        Decoded tokens per singular vector.
    tokens : list[str] | None
        Labels for the tokens (defaults to ``result.tokens`` or the ids).
    """
    unembed, embed = _matrices(model, result)
    labels = tokens or result.tokens or [str(i) for i in result.token_ids]
    n = len(result.token_ids)
    spec, lid, lsc, rid, rsc, picks, shares = _decode(result.combined(), result.produced, n, unembed, embed, k, top)
    combined = DecodedOperator("combined", None, spec, lid, lsc, rid, rsc, picks.tolist(), shares.tolist())
    per_token = []
    for pos in range(n):
        op = result.operator(pos)
        produced = op @ result.embeddings[pos]
        spec, lid, lsc, rid, rsc, _, _ = _decode(op, produced, 1, unembed, embed, k, top)
        per_token.append(DecodedOperator(labels[pos], pos, spec, lid, lsc, rid, rsc, [pos] * len(spec[:k]),
                                         [1.0] * len(spec[:k])))
    return Explanation(result, combined, per_token)


def explain_summed(result: JacobianResult, model: torch.nn.Module, k: int = 5, top: int = 5) -> DecodedOperator:
    """Decode the top ``k`` singular triplets of ``sum_k J_k`` (the operator on a direction shared by every
    token): left vectors through the unembedding, right vectors through the input embedding."""
    unembed, embed = _matrices(model, result)
    spec, lid, lsc, rid, rsc, _, _ = _decode(result.summed(), result.produced, 1, unembed, embed, k, top)
    return DecodedOperator("summed", None, spec, lid, lsc, rid, rsc, [0] * len(spec[:k]), [1.0] * len(spec[:k]))


def _matrices(model: torch.nn.Module, result: JacobianResult) -> tuple[torch.Tensor, torch.Tensor]:
    """(unembedding, input embedding), each (vocab, d), on the result's device."""
    mats = model_decoding_matrices(model)
    device = result.jacobian.device
    return mats["unembedding"].to(device), mats["embedding"].to(device)
