"""The corpus page: the run, one row per complete prompt (a damaged one with why), and the failed prompts.

A row is read from the prompt's attributes alone (:meth:`~detjac.store.reader.StoreReader.prompt_attrs`), once:
a committed prompt never changes, so reopening the page reads only the prompts added since.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..store import damage_reason
from .jsonable import jsonable

if TYPE_CHECKING:
    from ..store import StoreReader

RUN_KEYS = ("model_id", "model_type", "family", "revision", "dtype", "keep", "detach", "engine", "layerwise",
            "quantize", "mode", "detjac_version")


def prompt_row(prompt_id: str, a: dict[str, Any]) -> dict[str, Any]:
    """What the corpus lists of one prompt (from its attributes ``a``): id, line, text, length, reconstruction
    error, next token, kind."""
    next_id = a.get("next_token_id")
    return jsonable({"id": prompt_id, "line": a.get("line"), "text": a.get("prompt", ""),
                     "n_tokens": a.get("n_tokens"), "error": a.get("reconstruction_error"),
                     "detached": a.get("detached", True), "next_token": a.get("next_token") or str(next_id),
                     "next_token_id": next_id, "low_rank": "rank" in a, "layerwise": len(a.get("layerwise") or {})})


def damaged_row(prompt_id: str, reason: str) -> dict[str, Any]:
    """A prompt whose attributes cannot be read as committed (as ``detjac store ls`` lists it: DAMAGED)."""
    return {"id": prompt_id, "line": None, "text": "", "n_tokens": None, "error": None, "detached": True,
            "next_token": "", "next_token_id": None, "low_rank": False, "layerwise": 0, "damage": reason}


def failure_row(prompt_id: str, record: dict[str, Any]) -> dict[str, Any]:
    """A failed prompt: its text, line, stage, error class and reason."""
    return jsonable({"id": prompt_id, "text": record.get("prompt", ""), "line": record.get("line"),
                     "stage": record.get("stage"), "error": record.get("error"), "reason": record.get("reason"),
                     "failed_at": record.get("failed_at")})


class Corpus:
    """The corpus page of one store, its rows kept once read (see the module docstring)."""

    def __init__(self, store: StoreReader) -> None:
        self.store = store
        self._rows: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def payload(self) -> dict[str, Any]:
        """``store`` (name, run settings, creation time), ``prompts`` (rows in id order; a damaged prompt's row has
        ``damage``, the reason), ``failures``."""
        with self._lock:
            ids = self.store.prompt_ids()
            rows = []
            for pid in ids:
                if pid not in self._rows:
                    try:
                        self._rows[pid] = prompt_row(pid, self.store.prompt_attrs(pid))
                    except StoreError as exc:  # listed with its reason, read again next time
                        rows.append(damaged_row(pid, damage_reason(exc)))
                        continue
                rows.append(self._rows[pid])
        failures = [failure_row(pid, record) for pid, record in self.store.failures().items()]
        run = {key: self.store.run[key] for key in RUN_KEYS if key in self.store.run}
        return {"store": jsonable({"name": self.store.path.name, "created": self.store.created,
                                   "format_version": self.store.format_version, "run": run}),
                "prompts": rows, "failures": failures}
