"""Tokens as text for people: a token id shown as its quoted piece (torch-free; the CLI and the engine's results)."""

from __future__ import annotations

from typing import Any


def piece(tokenizer: Any, token_id: int) -> str:
    """A token as its quoted text (or its id without a tokenizer)."""
    return repr(tokenizer.decode([token_id])) if tokenizer is not None else str(token_id)


def pieces(tokenizer: Any, ids: list[int]) -> str:
    """Tokens as their quoted texts, space-separated."""
    return " ".join(piece(tokenizer, i) for i in ids)
