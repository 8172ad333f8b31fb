"""Text rendering of Jacobian results for the terminal (no heavy imports at module level)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click


def piece(tokenizer: Any, token_id: int) -> str:
    """A token as its quoted text (or its id without a tokenizer)."""
    return repr(tokenizer.decode([token_id])) if tokenizer is not None else str(token_id)


def pieces(tokenizer: Any, ids: list[int]) -> str:
    return " ".join(piece(tokenizer, i) for i in ids)


def echo_prediction(result: Any, tokenizer: Any, stock_logit_diff: float | None = None) -> None:
    """Tokens, next token with its probability, and the reconstruction error."""
    click.echo(f"  tokens ({len(result.token_ids)}): {pieces(tokenizer, result.token_ids)}")
    probs = result.logits.softmax(-1)
    agree = "same" if result.reconstructed_next_token_id == result.next_token_id else "DIFFERENT"
    click.echo(f"  next token {piece(tokenizer, result.next_token_id)} (p={float(probs[result.next_token_id]):.3f}); "
               f"from the reconstruction sum_k J_k x_k: {agree}")
    line = f"  {str(result.dtype).removeprefix('torch.')} reconstruction error {result.reconstruction_error:.2e}"
    if stock_logit_diff is not None:
        line += f"; max |logit - stock logit| {stock_logit_diff:.2e}"
    click.echo(line)


def _echo_operator(op: Any, tokenizer: Any, labels: list[str], indent: str) -> None:
    for i, sigma in enumerate(op.singular_values.tolist()):
        left = pieces(tokenizer, op.left_ids[i].tolist())
        right = pieces(tokenizer, op.right_ids[i].tolist())
        where = ""
        if op.position is None:
            where = f" [at {labels[op.right_positions[i]]!s}, {op.right_shares[i]:.0%} of |v|^2]"
        click.echo(f"{indent}#{i + 1} sigma {sigma:<9.4g} left -> {left}")
        click.echo(f"{indent}{'':16}right{where} -> {right}")


def echo_explanation(expl: Any, tokenizer: Any, per_token_k: int = 1) -> None:
    """Combined operator's triplets in full, then the leading ``per_token_k`` of every token."""
    res = expl.result
    labels = [piece(tokenizer, t) for t in res.token_ids]
    n, d = len(res.token_ids), res.embeddings.shape[-1]
    values = " ".join(f"{s:.3g}" for s in expl.combined.spectrum[:8].tolist())
    click.echo(f"  combined [J_1 ... J_n] ({res.output.shape[0]} x {n * d}); top singular values: {values}")
    _echo_operator(expl.combined, tokenizer, labels, "    ")
    click.echo(f"  per token J_k (top {per_token_k} triplet{'s' if per_token_k > 1 else ''} each):")
    for op in expl.per_token:
        top_values = " ".join(f"{s:.3g}" for s in op.spectrum[:3].tolist())
        click.echo(f"   {labels[op.position]:>14} sigma {top_values}")
        trimmed = replace(op, left_ids=op.left_ids[:per_token_k], right_ids=op.right_ids[:per_token_k])
        _echo_operator(trimmed, tokenizer, labels, "      ")
