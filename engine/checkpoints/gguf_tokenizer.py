"""The tokenizer of a GGUF file: its metadata checked (a known tokenizer model, a non-empty token list, special
token ids inside it) before transformers builds it, so bad metadata is one clear line, not an IndexError."""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Any

from detjac.errors import CheckpointError

from .gguf_header import GGUFHeader, _stat, read_gguf_header
from .quiet import quiet_tokenizer

TOKENIZER_MODEL = "tokenizer.ggml.model"
SPECIAL_IDS = ("bos", "eos", "unknown", "padding", "seperator", "cls", "mask")  # tokenizer.ggml.<x>_token_id


def check_tokenizer(header: GGUFHeader) -> None:
    """Refuse tokenizer metadata transformers would fail on with an IndexError or ValueError.

    Raises
    ------
    CheckpointError
        An unknown ``tokenizer.ggml.model``, an empty or missing token list, or a special token id outside it;
        the message names the key and the value.
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_TYPES

    kind = header.metadata.get(TOKENIZER_MODEL)
    if kind not in GGUF_TOKENIZER_TYPES:
        raise CheckpointError(f"Expected {TOKENIZER_MODEL} to be one of {', '.join(sorted(GGUF_TOKENIZER_TYPES))} in "
                              f"the GGUF file {header.path}. Got {kind!r}.")
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    count = getattr(tokens, "length", None)
    if not count:
        raise CheckpointError(f"Expected a non-empty token list (tokenizer.ggml.tokens) in the GGUF file "
                              f"{header.path}. Got {'an empty one' if count == 0 else repr(tokens)}.")
    for special in SPECIAL_IDS:
        key = f"tokenizer.ggml.{special}_token_id"
        value = header.metadata.get(key)
        if value is not None and (type(value) is not int or not 0 <= value < count):
            raise CheckpointError(f"Expected {key} to be a token id below {count} (the token list's length) in the "
                                  f"GGUF file {header.path}. Got {value!r}.")


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer transformers builds from the GGUF file's tokenizer metadata: built once per file (its size and
    modification time) in a process, since building it parses every token of the metadata again (about 15 s for
    Gemma 3's 262,144 on 2 cores), then a copy each time (about 1 s), so no caller changes another's."""
    return copy.deepcopy(_tokenizer(path, *_stat(path)))


@lru_cache(maxsize=4)
def _tokenizer(path: Path, size: int, mtime_ns: int) -> Any:
    from transformers import AutoTokenizer

    check_tokenizer(read_gguf_header(path))
    return quiet_tokenizer(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
