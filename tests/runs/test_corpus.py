"""The default model's recipe (``scripts/gcide.py``: corpus preparation, held-out split and prompts,
learning-rate schedule), offline on synthetic input."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest

from scripts import gcide

DICT = """\
00-database-short
   The Collaborative International Dictionary of English v.0.48

Arrogance \\Ar"ro*gance\\, n. [F., fr. L. arrogantia, fr.
   arrogans. See {Arrogant}.]
   The act or habit of arrogating; proud contempt of others;
   haughtiness. --Shak.
   [1913 Webster]

         I hate not you for her proud arrogance.  --Shak.
   [1913 Webster]

   Syn: Haughtiness; hauteur; assumption; lordliness.
        [1913 Webster]

Abbacy (b"b*s), n.; pl. Abbacies (-sz). The dignity, estate, or
   jurisdiction of an abbot. [Obs.]
   [1913 Webster]
"""


def _deb(members: dict[str, bytes]) -> bytes:
    """A minimal .deb: ar archive with debian-binary and data.tar.xz holding ``members``."""
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w:xz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = b"!<arch>\n"
    for name, data in (("debian-binary", b"2.0\n"), ("data.tar.xz", payload.getvalue())):
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    return out


def test_entries_are_cleaned_to_plain_lines():
    deb = _deb({gcide.DICT_MEMBER: gzip.compress(DICT.encode()), gcide.COPYRIGHT_MEMBER: b"GPL"})
    assert gcide.entries(deb) == [
        "Arrogance, n. The act or habit of arrogating; proud contempt of others; haughtiness. "
        "Syn: Haughtiness; hauteur; assumption; lordliness.",
        "Abbacy, n.; pl. Abbacies. The dignity, estate, or jurisdiction of an abbot.",
    ]
    assert gcide.read_package(deb)[1] == "GPL"


def test_not_a_deb_is_refused():
    with pytest.raises(RuntimeError, match="Expected a Debian package"):
        gcide.read_package(b"PK\x03\x04 not an ar archive")


def test_cached_package_with_wrong_checksum_is_refused(tmp_path):
    (tmp_path / gcide.URL.rsplit("/", 1)[1]).write_bytes(b"tampered")
    with pytest.raises(RuntimeError, match=f"Expected .* with SHA-256 {gcide.SHA256}"):
        gcide.fetch_deb(tmp_path)


def test_heldout_split_is_deterministic_and_small():
    lines = [f"Word{i}, n. A definition number {i}." for i in range(2000)]
    held = [line for line in lines if gcide.is_heldout(line)]
    assert held == [line for line in lines if gcide.is_heldout(line)]
    assert 10 < len(held) < 80
    assert gcide.split_entries(lines) == ([line for line in lines if line not in held], held)


def test_heldout_prompts_are_prefixes_that_leave_a_continuation():
    texts = [f"Word{i}, n. " + " ".join(f"w{j}" for j in range(i % 20)) for i in range(400)]
    prompts = gcide.entry_prefixes(texts, 50)
    assert len(prompts) == 50 and len(set(prompts)) == 50
    for prompt in prompts:
        source = next(t for t in texts if t.startswith(prompt + " "))
        assert 6 <= len(prompt.split()) <= 16 and len(prompt.split()) < len(source.split())


def test_learning_rate_warms_up_then_decays_to_the_floor():
    cfg = dict(gcide.TRAIN, steps=100, warmup=10)
    lrs = [gcide.lr_at(s, cfg) for s in range(100)]
    assert lrs[9] == pytest.approx(cfg["lr"]) and lrs[0] == pytest.approx(cfg["lr"] / 10)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lrs[-1] == pytest.approx(cfg["lr"] * cfg["final_lr_fraction"], rel=1e-2)
