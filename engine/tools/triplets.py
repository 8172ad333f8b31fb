"""Singular triplets of a detached Jacobian, per token and combined, decoded to tokens.

Left vectors are decoded through the unembedding, right vectors through the input embeddings, and each pair's sign is
fixed by :mod:`detjac.singular`. Details: docs/engine.md, "Decoded singular triplets"."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from detjac.sinks import sink_note
from detjac.tokens import piece, pieces

from ..interface import Engine
from ..products.decode import SingularTriplets, decode_blocks, decode_top, dense_svd
from ..result import JacobianResult
from ..selection import as_engine


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


@dataclass(frozen=True, repr=False)
class Explanation:
    """A Jacobian result with its combined and per-token decoded operators; ``str()`` gives the decoded table as
    ``detjac jacobian`` prints it, Jupyter an HTML table of the combined operator."""

    result: JacobianResult
    combined: DecodedOperator
    per_token: list[DecodedOperator]
    tokenizer: Any = field(default=None, compare=False)

    def lines(self, per_token_k: int = 1) -> list[str]:
        """The combined operator's triplets in full, then the leading ``per_token_k`` of every token."""
        res, tok = self.result, self.tokenizer
        labels = [piece(tok, t) for t in res.token_ids]
        n, d = len(res.token_ids), res.embeddings.shape[-1]
        values = " ".join(f"{s:.3g}" for s in self.combined.spectrum[:8].tolist())
        out = [f"  combined [J_1 ... J_n] ({res.output.shape[0]} x {n * d}); top singular values: {values}"]
        out += _operator_lines(self.combined, tok, labels, "    ")
        out.append(f"  per token J_k (top {per_token_k} triplet{'s' if per_token_k > 1 else ''} each):")
        for op in self.per_token:
            top_values = " ".join(f"{s:.3g}" for s in op.spectrum[:3].tolist())
            out.append(f"   {labels[op.position]:>14} sigma {top_values}")
            trimmed = replace(op, left_ids=op.left_ids[:per_token_k], right_ids=op.right_ids[:per_token_k])
            out += _operator_lines(trimmed, tok, labels, "      ")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __repr__(self) -> str:
        s = self.result.summary()
        sigma = ", ".join(f"{v:.3g}" for v in self.combined.singular_values.tolist()[:3])
        return (f"<Explanation {s['model']}, {s['prompt']}: {s['tokens']} tokens, {len(self.combined.left_ids)} "
                f"triplets per operator; combined sigma {sigma}; print() it for the decoded tokens>")

    def _sink(self, i: int) -> str:
        """The attention-sink flag of the combined operator's ``i``-th right vector (:func:`detjac.sinks.sink_note`)."""
        flag = sink_note(int(self.combined.right_positions[i]), float(self.combined.right_shares[i]))
        return f"; {flag}" if flag else ""

    def _repr_html_(self) -> str:
        from html import escape

        tok, res = self.tokenizer, self.result
        labels = [piece(tok, t) for t in res.token_ids]
        rows = "".join(
            f"<tr><td>{i + 1}</td><td>{sigma:.4g}</td><td>{escape(pieces(tok, self.combined.left_ids[i].tolist()))}"
            f"</td><td>{escape(labels[self.combined.right_positions[i]])} "
            f"({self.combined.right_shares[i]:.0%}{self._sink(i)})</td>"
            f"<td>{escape(pieces(tok, self.combined.right_ids[i].tolist()))}"
            "</td></tr>" for i, sigma in enumerate(self.combined.singular_values.tolist()))
        head = "".join(f"<th>{h}</th>" for h in ("#", "σ", "left → (unembedding)", "right at token",
                                                 "right → (embedding)"))
        return (f"<div><b>{escape(repr(self))}</b><table style='text-align:left'><tr>{head}</tr>{rows}</table>"
                "</div>")


def _operator_lines(op: DecodedOperator, tokenizer: Any, labels: list[str], indent: str) -> list[str]:
    out = []
    for i, sigma in enumerate(op.singular_values.tolist()):
        left = pieces(tokenizer, op.left_ids[i].tolist())
        right = pieces(tokenizer, op.right_ids[i].tolist())
        where = ""
        if op.position is None:
            position, share = int(op.right_positions[i]), float(op.right_shares[i])
            flag = sink_note(position, share)
            where = f" [at {labels[position]!s}, {share:.0%} of |v|^2{'; ' + flag if flag else ''}]"
        out.append(f"{indent}#{i + 1} sigma {sigma:<9.4g} left -> {left}")
        out.append(f"{indent}{'':16}right{where} -> {right}")
    return out


def _decode(op: torch.Tensor, produced: torch.Tensor, n_blocks: int, unembed: Any, embed: Any,
            k: int, top: int) -> tuple[torch.Tensor, ...]:
    """Decode the top ``k`` triplets of ``op`` (d, n_blocks * d); returns tensors and block picks."""
    full = dense_svd(op, min(op.shape), orient=produced)  # one SVD: the spectrum and the top k
    spectrum = full.S
    svd = SingularTriplets(full.U[:, :k], full.S[:k], full.V[:, :k])
    left_ids, left_scores = decode_top(svd.U, unembed, top)
    right_ids, right_scores, picks, shares = decode_blocks(svd.V, n_blocks, embed, top)
    return spectrum, left_ids, left_scores, right_ids, right_scores, picks, shares


def explain(result: JacobianResult, model: Engine | torch.nn.Module, k: int = 5, top: int = 5,
            tokens: list[str] | None = None) -> Explanation:
    """Decode the top ``k`` singular triplets of ``[J_1 ... J_n]`` and of every ``J_k``.

    Parameters
    ----------
    result : JacobianResult
        From :func:`~detjac.engine.verbs.jacobian`.
    model : Engine or torch.nn.Module
        The engine (or loaded model) the result came from (its input and output embedding matrices are used).
    k : int
        Triplets per operator.
    top : int
        Decoded tokens per singular vector.
    tokens : list[str] | None
        Labels for the tokens (defaults to ``result.tokens`` or the ids).
    """
    engine = as_engine(model)
    unembed, embed = _matrices(engine, result)
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
    # The engine's tokenizer, whichever engine: an explanation decodes ids to text as everything else does.
    tokenizer = engine.tokenizer if engine.tokenizer is not None else result.tokenizer
    return Explanation(result, combined, per_token, tokenizer)


def explain_summed(result: JacobianResult, model: Engine | torch.nn.Module, k: int = 5,
                   top: int = 5) -> DecodedOperator:
    """Decode the top ``k`` singular triplets of ``sum_k J_k`` (the operator on a direction shared by every
    token): left vectors through the unembedding, right vectors through the input embedding."""
    unembed, embed = _matrices(model, result)
    spec, lid, lsc, rid, rsc, _, _ = _decode(result.summed(), result.produced, 1, unembed, embed, k, top)
    return DecodedOperator("summed", None, spec, lid, lsc, rid, rsc, [0] * len(spec[:k]), [1.0] * len(spec[:k]))


def _matrices(model: Engine | torch.nn.Module, result: JacobianResult) -> tuple[Any, Any]:
    """(unembedding, input embedding), each (vocab, d), as the engine hands them out for decoding a block of rows at
    a time (:meth:`~detjac.engine.Engine.decoding_rows`: never whole in the compute dtype where it keeps a budget)."""
    rows = as_engine(model).decoding_rows()
    return rows["unembedding"], rows["embedding"]
