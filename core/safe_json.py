"""The one way detjac parses JSON it did not just write itself (files a user or another program hands it).

Python's ``json`` turns some inputs into errors that are not ``ValueError`` or into values no detjac file holds:
``[[[[...]]]]`` nested a hundred thousand deep raises ``RecursionError``; an integer of 5,000 digits raises a
``ValueError`` deep in the parser, and one of 4,000 digits parses, then overflows later (``float(n)``); ``NaN``,
``Infinity`` and ``1e400`` parse as floats that are not finite. :func:`parse_json` refuses all of them as an
:class:`~detjac.errors.UnreadableJSONError` (a ``DetjacError`` and a ``ValueError``, so callers that already catch
``ValueError`` for invalid JSON keep working) whose message is a phrase that completes "Got ...".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .errors import UnreadableJSONError

MAX_INT_DIGITS = 40  # far beyond any count, id, seed or size a detjac file holds (2**64 has 20 digits)


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise UnreadableJSONError(f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise UnreadableJSONError(f"the number {text[:40]}, which is not finite as a float")
    return value


def _constant(name: str) -> Any:
    raise UnreadableJSONError(f"invalid JSON: {name}, which standard JSON does not have")


def parse_json(text: str | bytes) -> Any:
    """``text`` parsed as standard JSON, refusing what no detjac file holds.

    Parameters
    ----------
    text : str or bytes
        The JSON text (bytes are read as UTF-8).

    Returns
    -------
    Any
        The parsed value.

    Raises
    ------
    UnreadableJSONError
        Invalid JSON, values nested too deep to read, an integer of more than ``MAX_INT_DIGITS`` digits, ``NaN``,
        ``Infinity`` or a float that overflows. The message completes "Got ...": "values nested too deep to read".
    """
    try:
        return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except UnreadableJSONError:
        raise
    except RecursionError:
        raise UnreadableJSONError("values nested too deep to read") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UnreadableJSONError(f"invalid JSON: {exc}") from None


def read_json(path: str | Path) -> Any:
    """The JSON file ``path`` parsed by :func:`parse_json` (``OSError`` where it cannot be read)."""
    return parse_json(Path(path).read_bytes())
