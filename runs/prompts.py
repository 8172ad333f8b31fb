"""Prompts files and their tokens: what a run reads before it touches a store.

``.txt``: one prompt per line; ``.jsonl``: one ``{"prompt": ...}`` (or ``"text"``) object per line, other fields kept
as metadata, a prompt given as token ids used as it is. Details: docs/user-guide.md, "Runs over prompt files, stored
on disk"."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detjac.errors import PromptError, PromptsFileError
from detjac.safe_json import parse_json


@dataclass(frozen=True)
class PromptLine:
    line: int  # 1-based line number in the prompts file
    text: str
    meta: dict[str, Any] = field(default_factory=dict)
    ids: tuple[int, ...] | None = None  # token ids given instead of text (JSONL); text is then their JSON list

    @property
    def prompt(self) -> str | list[int]:
        """What the engine tokenizes: the text, or the token ids as given."""
        return self.text if self.ids is None else list(self.ids)


@dataclass
class PromptsFile:
    path: Path
    prompts: list[PromptLine]
    blank: int

    def __str__(self) -> str:
        return str(self.path)

    def digest(self) -> str:
        """SHA-256 of the prompts as parsed, whatever the file's name or format: each prompt's line number, its kind
        (``text`` or token ``ids``) and its text or ids. A ``.txt`` line ``[1, 450]`` (text) and a ``.jsonl``
        ``{"prompt": [1, 450]}`` (ids) differ; metadata fields of a ``.jsonl`` line are left out (the engine never
        reads them)."""
        sha = hashlib.sha256()
        for item in self.prompts:
            kind, value = ("text", item.text) if item.ids is None else ("ids", list(item.ids))
            sha.update((json.dumps([item.line, kind, value]) + "\n").encode())
        return sha.hexdigest()


FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl"}  # by suffix; any other needs the format named


def check_prompts_path(path: str | Path) -> Path:
    """``path`` as a prompts file that exists (PromptsFileError otherwise): checked by the CLI as it parses, before
    anything heavy is imported, and by :func:`read_prompts`."""
    path = Path(path)
    if not path.exists():
        raise PromptsFileError(f"Expected a prompts file at {path}. Got no such file.")
    if not path.is_file():
        raise PromptsFileError(f"Expected a prompts file at {path}. Got a folder.")
    return path


def read_prompts(path: str | Path, fmt: str | None = None) -> PromptsFile:
    """Prompts of a ``.txt`` (one per line) or ``.jsonl`` / ``.ndjson`` (``{"prompt": ..., ...}`` per line) file;
    ``fmt`` (``"txt"`` or ``"jsonl"``) reads a file of another name.

    Lines end at ``\n`` (or ``\r\n``) only: a lone ``\r``, a form feed, U+0085 or U+2028 inside a prompt stays in
    it. A UTF-8 byte-order mark is dropped. Blank lines are skipped and counted. Raises PromptsFileError for a missing,
    unreadable, empty or malformed file (naming the line), or a name whose format is not known.
    """
    path = check_prompts_path(path)
    kind = fmt or FORMATS.get(path.suffix.lower())
    if kind not in ("txt", "jsonl"):
        raise PromptsFileError(f"Expected a prompts file named .txt (one prompt per line) or .jsonl / .ndjson (one "
                               f"JSON object per line), or its format given (--prompts-format txt|jsonl). Got "
                               f"{path.name!r}" + (f" with format {fmt!r}." if fmt else "."))
    try:
        text = path.read_bytes().decode("utf-8")  # not read_text: its universal newlines would split at a lone \r
    except UnicodeDecodeError as exc:
        raise PromptsFileError(f"Expected UTF-8 text in {path}. Got undecodable bytes at offset {exc.start}.") from exc
    except OSError as exc:
        raise PromptsFileError(f"Expected a readable prompts file at {path}. Got: {exc.strerror}.") from exc
    jsonl = kind == "jsonl"
    lines = text.removeprefix("\ufeff").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    prompts, blank = [], 0
    for number, raw in enumerate((line.removesuffix("\r") for line in lines), start=1):
        if not raw.strip():
            blank += 1
            continue
        prompts.append(_parse_jsonl_line(path, number, raw) if jsonl else PromptLine(number, raw))
    if not prompts:
        raise PromptsFileError(f"Expected at least one prompt in {path}. Got an empty file"
                               + (f" ({blank} blank lines)." if blank else "."))
    return PromptsFile(path, prompts, blank)


def _parse_jsonl_line(path: Path, number: int, raw: str) -> PromptLine:
    try:
        record = parse_json(raw)
    except ValueError as exc:
        raise PromptsFileError(f"Expected a JSON object on line {number} of {path}. Got {exc}.") from exc
    key = "prompt" if isinstance(record, dict) and "prompt" in record else "text"
    value = record.get(key) if isinstance(record, dict) else None
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        record.pop(key)
        return PromptLine(number, json.dumps(value), record, tuple(value))
    if not isinstance(value, str):
        raise PromptsFileError(f'Expected {{"prompt": "..."}} (or "text"; or token ids, {{"prompt": [1, 2, 3]}}) on '
                               f"line {number} of {path}. Got {raw[:80]!r}.")
    return PromptLine(number, record.pop(key), record)


@dataclass(frozen=True)
class Tokenized:
    """A prompt's token ids, or why it cannot be run (``error``; the ids are then as far as they got)."""

    ids: list[int]
    error: str | None = None
    too_long: bool = False


def tokenize_each(prompts: PromptsFile, model: Any, tokenizer: Any, max_tokens: int) -> list[Tokenized]:
    """Token ids of every prompt, each checked on its own: a prompt the tokenizer or the model refuses, or one
    longer than ``max_tokens``, gets the reason instead of stopping the others."""
    from detjac.engine import parse_prompt

    out = []
    for item in prompts.prompts:
        try:
            tokens = parse_prompt(item.prompt, model, tokenizer)
        except PromptError as exc:
            out.append(Tokenized([], f"Line {item.line} of {prompts.path}: {exc}"))
            continue
        if len(tokens) > max_tokens:
            out.append(Tokenized(tokens, f"Expected a prompt of at most {max_tokens} tokens (--max-tokens). Got "
                                         f"{len(tokens)} tokens on line {item.line} of {prompts.path}.", True))
        else:
            out.append(Tokenized(tokens))
    return out


def check_tokenized(prompts: PromptsFile, results: list[Tokenized], max_tokens: int) -> None:
    """Raise PromptError for the first prompt the tokenizer refused, else one listing every prompt that is too
    long (a run in one process refuses the whole file before it touches the store)."""
    refused = next((r.error for r in results if r.error is not None and not r.too_long), None)
    if refused is not None:
        raise PromptError(refused)
    too_long = [f"line {item.line} ({len(r.ids)} tokens)" for item, r in zip(prompts.prompts, results, strict=True)
                if r.too_long]
    if too_long:
        shown = ", ".join(too_long[:10]) + (f" and {len(too_long) - 10} more" if len(too_long) > 10 else "")
        raise PromptError(f"Expected prompts of at most {max_tokens} tokens (--max-tokens). Got longer ones in "
                          f"{prompts.path}: {shown}. Nothing was written.")


def tokenize_all(prompts: PromptsFile, model: Any, tokenizer: Any, max_tokens: int) -> list[list[int]]:
    """Token ids of every prompt; raises PromptError as :func:`check_tokenized` does."""
    results = tokenize_each(prompts, model, tokenizer, max_tokens)
    check_tokenized(prompts, results, max_tokens)
    return [r.ids for r in results]
