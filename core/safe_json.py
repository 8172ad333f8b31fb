"""The one way detjac parses JSON it did not just write itself (files a user or another program hands it).

Python's ``json`` turns some inputs into errors that are not ``ValueError`` or into values no detjac file holds:
``[[[[...]]]]`` nested a hundred thousand deep raises ``RecursionError``; an integer of 5,000 digits raises a
``ValueError`` deep in the parser, and one of 4,000 digits parses, then overflows later (``float(n)``); ``NaN``,
``Infinity`` and ``1e400`` parse as floats that are not finite. :func:`parse_json` refuses all of them as an
:class:`~detjac.errors.UnreadableJSONError` (a ``DetjacError`` and a ``ValueError``, so callers that already catch
``ValueError`` for invalid JSON keep working) whose message is a phrase that completes "Got ...".

:func:`read_json` reads a file for :func:`parse_json` only when it is a regular file (a link is followed, then what
it names is checked: a FIFO, a device, a socket or a folder is refused before a byte is read, so ``/dev/zero`` cannot
grow without end and a FIFO cannot hang), and only up to the cap of its kind (:data:`MAX_BYTES`): the size is
checked on the open file before reading, and at most one byte past the cap is ever read (a file that grows, or
reports no size as ``/proc`` files do, is still bounded).
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from .errors import InvalidArgumentError, UnreadableJSONError

MAX_INT_DIGITS = 40  # far beyond any count, id, seed or size a detjac file holds (2**64 has 20 digits)

# The most bytes each kind of file detjac parses may hold. A graph's JSON is the largest: SmolLM2's pruned graph of
# "The capital of France is" at the default 7,500 nodes is 78 MB (1M links), and an unpruned one of 7,500 nodes can
# reach about 2 GB (28M links); circuit-tracer's users report 1.7 GB. An attention (QK) file of SmolLM2 holds about
# 270k terms (under 20 MB); more neurons per MLP (``--neurons``) multiply that. Store, index and lens metadata
# (``zarr.json``, a folder's graph index, caches) hold attributes and lists: a few MB at most.
GRAPH_MAX_BYTES = 4 * 2**30
ATTENTION_MAX_BYTES = 1 * 2**30
METADATA_MAX_BYTES = 64 * 2**20
MAX_BYTES = {"graph": GRAPH_MAX_BYTES, "attention": ATTENTION_MAX_BYTES, "metadata": METADATA_MAX_BYTES}
KIND_NAMES = {"graph": "a graph JSON file", "attention": "an attention file", "metadata": "a metadata file"}
READ_CHUNK = 16 * 2**20
FILE_TYPES = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
              (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


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


def _not_regular(mode: int) -> str | None:
    """What a file of ``mode`` is when it is not a regular file (None when it is)."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in FILE_TYPES if test(mode)), "not a regular file")


def _size(n: int) -> str:
    return f"{n // 2**30} GiB" if n % 2**30 == 0 else f"{n // 2**20} MiB" if n % 2**20 == 0 else f"{n:,} bytes"


def read_capped(path: str | Path, kind: str = "metadata") -> bytes:
    """The bytes of the regular file ``path`` (a link followed), at most :data:`MAX_BYTES` ``[kind]`` of them.

    Parameters
    ----------
    path : str or Path
        The file.
    kind : str
        ``graph``, ``attention`` or ``metadata`` (store, index and lens metadata): which cap applies.

    Raises
    ------
    UnreadableJSONError
        ``path`` is (or links to) a folder, a FIFO, a device or a socket, or holds more than the cap; nothing past
        one byte over the cap is read.
    OSError
        The file cannot be opened or read (missing, no permission, ...).
    """
    if kind not in MAX_BYTES:
        raise InvalidArgumentError(f"Expected a kind of file among {', '.join(MAX_BYTES)}. Got {kind!r}.")
    cap = MAX_BYTES[kind]
    what = _not_regular(os.stat(path).st_mode)  # before opening: a device is never opened
    if what is not None:
        raise UnreadableJSONError(f"{what}, not a regular file")
    # Non-blocking: were the file swapped for a FIFO after the check above, opening it would wait for a writer.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)  # what was opened, whatever the path names by now
        what = _not_regular(info.st_mode)
        if what is not None:
            raise UnreadableJSONError(f"{what}, not a regular file")
        if info.st_size > cap:
            raise UnreadableJSONError(f"a file of {info.st_size:,} bytes, more than the {_size(cap)} "
                                      f"{KIND_NAMES[kind]} may hold")
        parts, total = [], 0
        while total <= cap:
            chunk = os.read(fd, min(READ_CHUNK, cap + 1 - total))
            if not chunk:
                break
            parts.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > cap:
        raise UnreadableJSONError(f"a file that grew past the {_size(cap)} {KIND_NAMES[kind]} may hold while read")
    return b"".join(parts)


def read_json(path: str | Path, kind: str = "metadata") -> Any:
    """The JSON file ``path`` parsed by :func:`parse_json`, read by :func:`read_capped` (a regular file of at most
    :data:`MAX_BYTES` ``[kind]``: ``graph``, ``attention`` or ``metadata``).

    Raises
    ------
    UnreadableJSONError
        Not a regular file, larger than the cap of its kind, or not JSON :func:`parse_json` accepts.
    OSError
        The file cannot be opened or read.
    """
    return parse_json(read_capped(path, kind))
