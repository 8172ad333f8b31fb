"""Tokens as text for people: the one way a token id becomes text, used by the engine's results, ``explain``, the
store's records and analyses, and the CLI (torch-free, so every layer can import it).

A token's text is what the tokenizer decodes it to alone, special tokens kept (``'<s>'``) and no clean-up of spaces,
through the fast tokenizer's backend when there is one: that is the ``tokenizers.Tokenizer`` a store keeps as
``tokenizer.json``, so a token reads the same from a live model and from a store long after the model is gone.
Byte-level BPE pieces (``'Ġn'``) never reach a user: their text is ``' n'``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of one token, as its tokenizer decodes it alone.

    Parameters
    ----------
    tokenizer : transformers tokenizer or tokenizers.Tokenizer
        The model's tokenizer (a fast one is decoded through its backend, as a store's ``tokenizer.json`` is).
    token_id : int
        The token's id.

    Returns
    -------
    str
        Its text, special tokens included (``'<s>'``), spaces as written (``' n'``, never ``'Ġn'``).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the same decoder a store rebuilds from tokenizer.json: one text everywhere
        return backend.decode([int(token_id)], skip_special_tokens=False)
    return tokenizer.decode([int(token_id)], skip_special_tokens=False)


def token_texts(tokenizer: Any, ids: Iterable[int]) -> list[str] | None:
    """The texts of several tokens (:func:`token_text` each); None without a tokenizer."""
    return None if tokenizer is None else [token_text(tokenizer, i) for i in ids]


def token_labels(tokenizer: Any, ids: Iterable[int]) -> list[str]:
    """The texts of several tokens (:func:`token_texts`), or their ids as text without a tokenizer."""
    ids = list(ids)
    return token_texts(tokenizer, ids) or [str(i) for i in ids]


def piece(tokenizer: Any, token_id: int) -> str:
    """A token as its quoted text (or its id without a tokenizer)."""
    return repr(token_text(tokenizer, token_id)) if tokenizer is not None else str(token_id)


def pieces(tokenizer: Any, ids: Iterable[int]) -> str:
    """Tokens as their quoted texts, space-separated."""
    return " ".join(piece(tokenizer, i) for i in ids)
