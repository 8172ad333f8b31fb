"""Third-party warnings that detjac handles itself, silenced where they arise (one message, detjac's)."""

from __future__ import annotations

from typing import Any


def quiet_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer``, without transformers' "Token indices sequence length is longer than the specified maximum"
    warning: detjac checks every prompt's length against the model's context itself and says so in one message."""
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer
