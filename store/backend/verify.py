"""``verify`` beyond the prompts: the model arrays, analysis results, failure records and stray entries.

Each part is checked on its own and reported as a :class:`~detjac.store.reader.VerifyResult`, so one damaged
part never hides another and nothing raises; prompts are checked by :func:`.zarr_prompt.verify_prompt`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from detjac.errors import DetjacError

from .. import format as fmt
from ..integrity import NAME, PROMPT_ID, damage_reason
from ..reader import StoreReader, VerifyResult
from . import failed


def verify_store(store: StoreReader, model_sha256: dict[str, str], sealed: bool) -> list[VerifyResult]:
    """Every part of the store folder of ``store`` but its prompts, checked: ``model_sha256`` are the digests its
    root recorded at creation, ``sealed`` whether its format seals groups."""
    path: Path = store.path
    results = [*_stray(path), *_links(path)]
    results += _model(store, model_sha256, sealed)
    results += _analyses(store)
    results += _lenses(store)
    results += _failures(store, sealed)
    return results


def _bad(where: str, kind: str, reason: str) -> VerifyResult:
    return VerifyResult(where, False, None, reason, kind)


def _checked(where: str, kind: str, check: Any) -> VerifyResult:
    """Run ``check()``; a result ``ok``, or corrupt with the reason it raised."""
    try:
        check()
    except DetjacError as exc:
        return _bad(where, kind, damage_reason(exc))
    except Exception as exc:  # noqa: BLE001 - any failure to read a part means it is damaged
        return _bad(where, kind, f"unreadable: {type(exc).__name__}: {exc}")
    return VerifyResult(where, True, None, "", kind)


def _stray(path: Path) -> list[VerifyResult]:
    """Entries that do not belong: at the root, under prompts/ (not a 16-hex-digit id with its zarr.json)."""
    found = [_bad(entry.name, "store", "not part of a detjac store") for entry in sorted(path.iterdir())
             if entry.name not in fmt.STORE_ENTRIES and not entry.name.startswith(".")]
    prompts = path / fmt.PROMPTS
    if prompts.is_dir() and not prompts.is_symlink():
        found += [_bad(f"{fmt.PROMPTS}/{entry.name}", "store",
                       "not a prompt (expected 16 hex digits holding zarr.json)")
                  for entry in sorted(prompts.iterdir())
                  if entry.name != "zarr.json" and not (PROMPT_ID.fullmatch(entry.name) and entry.is_dir()
                                                         and (entry / "zarr.json").is_file())]
    return found


def _links(path: Path) -> list[VerifyResult]:
    """Every symlink inside the store (readers refuse them: they would lead outside)."""
    found = []
    for here, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            entry = Path(here) / name
            if entry.is_symlink():
                found.append(_bad(entry.relative_to(path).as_posix(), "store",
                                  f"a symlink (to {os.readlink(entry)}); symlinks inside a store are refused"))
    return found


def _model(store: StoreReader, model_sha256: dict[str, str], sealed: bool) -> list[VerifyResult]:
    """Each model array and file, decoded and compared with the SHA-256 recorded at creation."""
    folder = store.path / fmt.MODEL
    if not folder.is_dir() or folder.is_symlink():
        return [_bad(fmt.MODEL, "model", "the model group is missing")] if model_sha256 else []
    files = set(fmt.MODEL_FILES)
    results = []
    for name in sorted(model_sha256):
        read = (lambda n=name: store.model_bytes(n)) if name in files else (lambda n=name: store.model_array(n))
        result = _checked(f"{fmt.MODEL}/{name}", "model", read)
        if result.ok and name in files and store.model_bytes(name) is None:
            result = _bad(f"{fmt.MODEL}/{name}", "model", "missing (its SHA-256 was recorded at creation)")
        results.append(result)
    known = set(model_sha256) | {fmt.MODEL_FILES[n] for n in files & set(model_sha256)} | {"zarr.json"}
    if sealed:
        results += [_bad(f"{fmt.MODEL}/{entry.name}", "model", "not recorded when the store was created")
                    for entry in sorted(folder.iterdir()) if entry.name not in known]
    return results


def _analyses(store: StoreReader) -> list[VerifyResult]:
    """Each stored analysis result, its seal checked and its arrays decoded."""
    folder = store.path / fmt.ANALYSIS
    if not folder.is_dir() or folder.is_symlink():
        return []
    results = []
    for entry in sorted(folder.iterdir()):
        if entry.name == "zarr.json" or entry.is_symlink():
            continue
        if not PROMPT_ID.fullmatch(entry.name) or not entry.is_dir():
            results.append(_bad(f"{fmt.ANALYSIS}/{entry.name}", "analysis", "not a prompt id"))
            continue
        results += _sealed_groups(entry, f"{fmt.ANALYSIS}/{entry.name}", "analysis", "an analysis result",
                                  lambda n, p=entry.name: _read(store, p, n))
    return results


def _sealed_groups(folder: Path, where: str, kind: str, what: str, read: Any) -> list[VerifyResult]:
    """Each sealed group in ``folder`` checked by ``read(name)``; entries that are not groups reported."""
    results = []
    for entry in sorted(folder.iterdir()):
        if entry.name == "zarr.json" or entry.name.startswith(".") or entry.is_symlink():
            continue  # a group being replaced; symlinks are reported by _links
        if not NAME.fullmatch(entry.name) or not (entry / "zarr.json").is_file():
            results.append(_bad(f"{where}/{entry.name}", kind, f"not {what}"))
            continue
        results.append(_checked(f"{where}/{entry.name}", kind, lambda n=entry.name: read(n)))
    return results


def _lenses(store: StoreReader) -> list[VerifyResult]:
    """Each group under lens/ (the fitted lens, partial sums of a fit), its seal checked and its arrays decoded."""
    folder = store.path / fmt.LENS
    if not folder.is_dir() or folder.is_symlink():
        return []
    return _sealed_groups(folder, fmt.LENS, "lens", "a lens group", store.read_lens)


def _read(store: StoreReader, prompt_id: str, name: str) -> None:
    store.analyses.check(prompt_id, name)  # type: ignore[attr-defined]  # the zarr backend's cache


def _failures(store: StoreReader, sealed: bool) -> list[VerifyResult]:
    """Each failure record against its seal (format 2)."""
    if not sealed:
        return []
    try:
        ids = sorted(store.failures())
    except Exception as exc:  # noqa: BLE001
        return [_bad(fmt.FAILED, "failed", str(exc))]
    return [_checked(f"{fmt.FAILED}/{pid}", "failed", lambda p=pid: failed.check(store.path, p)) for pid in ids]
