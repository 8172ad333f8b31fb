"""Whole numbers written in text that detjac parses (a URL's path segment, a JSON key, an option's value): ASCII
digits only, and each number written one way.

Python's ``str.isdigit`` is True for ``'²'`` (which ``int`` then refuses with a ``ValueError``) and ``\\d`` in a
pattern matches ``'٣'`` (which ``int`` reads as 3, so a key ``"٣"`` would name the same index as ``"3"``).
:func:`parse_index` reads ``0``-``9`` only, without a sign, a space or a leading zero, and never builds a huge int.
"""

from __future__ import annotations

import re

MAX_DIGITS = 18  # below 2**63: any index, count or id detjac reads
_INDEX = re.compile(rf"0|[1-9][0-9]{{0,{MAX_DIGITS - 1}}}", re.ASCII)


def parse_index(text: object, below: int | None = None) -> int | None:
    """The non-negative integer ``text`` writes in ASCII digits (``"0"``, ``"17"``; not ``"017"``, ``"+1"``,
    ``" 1"``, ``"²"`` or ``"٣"``), or None where it writes none, or one not ``below`` the bound.

    Parameters
    ----------
    text : object
        What to read; anything but a ``str`` gives None.
    below : int, optional
        The bound the number must stay under (a length, a count).

    Returns
    -------
    int or None
    """
    if not isinstance(text, str) or not _INDEX.fullmatch(text):
        return None
    value = int(text)
    return value if below is None or value < below else None
