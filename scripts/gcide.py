"""How the shipped default model was made, without torch: its training corpus, the held-out split, the prompts
taken from it and the training settings (``engine/assets/gcide-llama/training.json`` records them);
``scripts/train_default_model.py`` runs the recipe with torch.

The corpus is GCIDE, from Debian's ``dict-gcide`` package: fetched from Debian's archive (pinned version, checked by
SHA-256), unpacked in pure Python (a ``.deb`` is an ``ar`` archive holding ``data.tar.xz``), and the dictionary
turned into one plain-English line per entry: headword, part of speech, senses and synonyms, without pronunciation
marks, etymologies, source tags or quotations. 2 % of the entries, chosen by a hash, are held out: prompts that
evaluate the model without its having seen them come from those (:func:`entry_prefixes`), a lens is fitted on
prefixes of the others.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import math
import re
import tarfile
import urllib.request
from pathlib import Path

PACKAGE = "dict-gcide"
VERSION = "0.48.5+nmu2"
URL = f"https://deb.debian.org/debian/pool/main/d/dict-gcide/dict-gcide_{VERSION}_all.deb"
SHA256 = "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f"
LICENCE = "GPL-2.0-or-later (GCIDE); Webster's 1913 text public domain; WordNet 1.5 licence"
DICT_MEMBER = "./usr/share/dictd/gcide.dict.dz"
COPYRIGHT_MEMBER = "./usr/share/doc/dict-gcide/copyright"

# The training settings of the shipped model (a re-run with the same corpus, torch and CPU reproduces its weights).
SEED = 20261123
VOCAB = 6144
CONTEXT = 128
MODEL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
             tie_word_embeddings=True)
TRAIN = dict(steps=800, batch=32, lr=2e-3, warmup=40, final_lr_fraction=0.1, weight_decay=0.1, clip=1.0,
             eval_every=50, eval_windows=64)
N_PROMPTS = 300  # held-out prompts written beside the model (benchmarks/data/heldout_prompts.txt)

_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_PRONUNCIATION = re.compile(r"\\[^\\]*\\")
_CROSS_REF = re.compile(r"\{([^{}]*)\}")
_CITATION = re.compile(r"--\s?[A-Z][\w.&' ]{0,40}?\.(?=\s|$)")
_SPACES = re.compile(r"\s+")
_HEAD_PRONUNCIATION = re.compile(r"\s\([^()]*[*`\"][^()]*\)")
_INFLECTION = re.compile(r"\s\(-[^()]*\)")


def fetch_deb(cache_dir: Path) -> bytes:
    """The pinned ``.deb``, from ``cache_dir`` when already there, else downloaded."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / URL.rsplit("/", 1)[1]
    if not path.exists():
        with urllib.request.urlopen(URL, timeout=120) as response:  # noqa: S310 (fixed https URL)
            data = response.read()
        path.with_suffix(".part").write_bytes(data)
        path.with_suffix(".part").rename(path)
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise RuntimeError(f"Expected {path.name} with SHA-256 {SHA256}. Got {digest} instead; delete it and retry.")
    return data


def _ar_members(data: bytes) -> dict[str, bytes]:
    """Members of an ``ar`` archive (the container format of ``.deb`` files)."""
    if not data.startswith(b"!<arch>\n"):
        raise RuntimeError("Expected a Debian package (ar archive). Got something else.")
    members, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        members[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)
    return members


def read_package(data: bytes) -> tuple[str, str]:
    """(dictionary text, copyright text) from the package bytes."""
    payload = _ar_members(data)["data.tar.xz"]
    with tarfile.open(fileobj=io.BytesIO(payload), mode="r:xz") as tar:
        dict_dz = tar.extractfile(DICT_MEMBER).read()  # type: ignore[union-attr]
        copyright_text = tar.extractfile(COPYRIGHT_MEMBER).read().decode()  # type: ignore[union-attr]
    return gzip.decompress(dict_dz).decode("utf-8", errors="replace"), copyright_text


def raw_entries(text: str) -> list[str]:
    """Dictionary entries: a line starting in column 0 opens one; indented lines continue it."""
    entries: list[list[str]] = []
    for line in text.splitlines():
        if line and not line[0].isspace():
            entries.append([line])
        elif entries:
            entries[-1].append(line)
    return ["\n".join(lines) for lines in entries if not lines[0].startswith("00-database")]


def clean_entry(raw: str) -> str:
    """One entry as a single plain line, e.g. ``Arrogance, n. The act or habit of ...``."""
    lines = raw.splitlines()
    # Quotations are indented deeper than senses (9+ columns) and carry no definition.
    head = _HEAD_PRONUNCIATION.sub("", lines[0], count=1)
    kept = [head] + [line for line in lines[1:] if len(line) - len(line.lstrip(" ")) < 9]
    text = " ".join(kept)
    text = _PRONUNCIATION.sub("", text, count=1)
    previous = None
    while previous != text:  # nested brackets: etymologies, source tags, [Obs.]
        previous, text = text, _BRACKETS.sub("", text)
    text = _CROSS_REF.sub(r"\1", text)
    text = _CITATION.sub("", text)
    text = _INFLECTION.sub("", text)
    text = _SPACES.sub(" ", text).strip()
    return text.replace(" ,", ",").replace(" .", ".").replace(" ;", ";")


def entries(data: bytes) -> list[str]:
    """Cleaned entries of the package, in dictionary order, empty and one-word ones dropped."""
    text, _ = read_package(data)
    cleaned = (clean_entry(raw) for raw in raw_entries(text))
    return [line for line in cleaned if len(line.split()) >= 4]


def is_heldout(entry: str, percent: int = 2) -> bool:
    """Deterministic held-out split by a hash of the whole entry line."""
    return int(hashlib.sha256(entry.encode()).hexdigest(), 16) % 100 < percent


def split_entries(lines: list[str]) -> tuple[list[str], list[str]]:
    """(training, held-out) entries, each in the order given."""
    return [line for line in lines if not is_heldout(line)], [line for line in lines if is_heldout(line)]


def entry_prefixes(texts: list[str], count: int) -> list[str]:
    """The first ``count`` entry prefixes of 6-16 words (length from a hash of the entry), in hash order.

    Every entry long enough to continue after its prefix is used; none is chosen by how the model does on it.
    """
    prompts = []
    for text in sorted(texts, key=lambda t: hashlib.sha256(t.encode()).hexdigest()):
        words = text.split()
        k = 6 + int(hashlib.sha256(text.encode()).hexdigest(), 16) % 11
        if len(words) > k:
            prompts.append(" ".join(words[:k]))
        if len(prompts) == count:
            break
    return prompts


def lr_at(step: int, cfg: dict) -> float:
    """The learning rate at ``step`` of training settings ``cfg`` (as :data:`TRAIN`): linear warm-up, then cosine
    decay to ``final_lr_fraction`` of the peak."""
    if step < cfg["warmup"]:
        return cfg["lr"] * (step + 1) / cfg["warmup"]
    progress = (step - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"])
    floor = cfg["final_lr_fraction"]
    return cfg["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
