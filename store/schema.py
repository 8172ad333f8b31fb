"""The types of the prompt attributes that readers use, checked before a prompt is handed out.

A reader trusts ``n_tokens``, ``reconstruction_error``, ``token_ids``, ... to be what the
format says (``docs/store-format.md``); a damaged or hand-edited attribute (text where a
number belongs, a list where a dtype name belongs) would otherwise surface as a traceback far
from its cause, or as a wrong figure. :func:`attrs_problem` names the first attribute that is
not of its type; the store reports such a prompt as damaged. Attributes a reader does not use
(``meta``, anything a caller of the Python API added) are not checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..exactness import DTYPE_BOUND
from .format import Keep


def _int(value: Any) -> bool:
    return type(value) is int


def _count(value: Any) -> bool:
    return _int(value) and value >= 1


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _keep(value: Any) -> bool:
    try:
        Keep.parse(value)
    except ValueError:
        return False
    return isinstance(value, str)


def _or_none(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(check(v) for v in value)


def _layerwise(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, dict) and _or_none(_number)(v.get("reconstruction_error"))
        for k, v in value.items())


CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "prompt": ("text", _text),
    "line": ("an integer or null", _or_none(_int)),
    "n_tokens": ("a positive integer", _count),
    "token_ids": ("a list of integers", _list_of(_int)),
    "tokens": ("a list of strings or null", _or_none(_list_of(_text))),
    "reconstruction_error": ("a finite number >= 0 or null", _or_none(_number)),
    "next_token_id": ("an integer or null", _or_none(_int)),
    "next_token": ("text or null", _or_none(_text)),
    "detached": ("true or false", lambda v: isinstance(v, bool)),
    "affine": ("true or false", lambda v: isinstance(v, bool)),
    "dtype": (f"one of {', '.join(DTYPE_BOUND)}", lambda v: isinstance(v, str) and v in DTYPE_BOUND),
    "storage_dtype": ("float64 or float32", lambda v: v in ("float64", "float32")),
    "position": ("an integer", _int),
    "keep": ("full, none or rank:K (Keep)", _keep),
    "rank": ("a positive integer", _count),
    "passes": ("a positive integer", _count),
    "combined_frobenius_sq": ("a finite number >= 0", _number),
    "combined_residual_sq": ("a finite number >= 0", _number),
    "combined_captured": ("a finite number >= 0", _number),
    "layerwise": ("a mapping of target names to {reconstruction_error, mode}", _layerwise),
    "lens": ("a mapping of to_output targets to reconstruction errors", lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and _number(e) for k, e in v.items())),
    "complete": ("true", lambda v: v is True),
}


def attrs_problem(attrs: Any) -> str | None:
    """What is wrong with a prompt's attributes, or None when every attribute readers use has its type."""
    if not isinstance(attrs, dict):
        return f"attributes are {type(attrs).__name__}, not a mapping"
    for key, (expected, check) in CHECKS.items():
        if key in attrs and not check(attrs[key]):
            return f"attribute {key!r} is {attrs[key]!r}, expected {expected}"
    ids, n = attrs.get("token_ids"), attrs.get("n_tokens")
    if isinstance(ids, list) and _count(n) and len(ids) != n:
        return f"attribute 'token_ids' has {len(ids)} ids, 'n_tokens' says {n}"
    return None
