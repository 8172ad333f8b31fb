"""The live viewer's interventions: one loaded engine answering JSON requests about one graph's prompt.

``detjac view GRAPH.json --model MODEL`` loads the model once (:func:`load_interventions`) and hands the server an
:class:`Interventions`, a callable from a request body (already parsed from JSON) to a JSON-able answer. The viewer
stays torch-free: it only calls it. A request is checked here before any work (:func:`parse_request`: its keys,
types and sizes; the engine checks the ranges against the model); the model must tokenize the graph's prompt into the
graph's own tokens, or the viewer is refused at start. Formulas: docs/graphs.md, "Interventions".
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from detjac.engine import Edit, intervene, load_engine
from detjac.errors import InvalidArgumentError
from detjac.tokens import token_labels

MAX_EDITS = 64  # a group of nodes, far more than a page selection holds
MAX_TOP_K = 50
MAX_VALUE_LENGTH = 65_536  # numbers in one head clamp: more than any head_dim
EDIT_KEYS = {"kind", "layer", "index", "position", "mode", "value"}
REQUEST_KEYS = {"edits", "top_k"}


def parse_request(body: Any) -> tuple[list[Edit], int]:
    """The edits and ``top_k`` of a request body ``{"edits": [{"kind", "layer", "index", "position", "mode",
    "value"?}, ...], "top_k"?}`` (JSON already parsed).

    Raises
    ------
    InvalidArgumentError
        Not an object, unknown or missing keys, values of the wrong type, no edit or more than :data:`MAX_EDITS`,
        ``top_k`` outside [1, :data:`MAX_TOP_K`].
    """
    if not isinstance(body, Mapping):
        raise InvalidArgumentError(f"Expected a JSON object with 'edits'. Got {type(body).__name__} instead.")
    _keys("request", body, REQUEST_KEYS, {"edits"})
    edits, top_k = body["edits"], body.get("top_k", 10)
    if not isinstance(edits, list) or not 1 <= len(edits) <= MAX_EDITS:
        got = f"{len(edits)} edits" if isinstance(edits, list) else type(edits).__name__
        raise InvalidArgumentError(f"Expected 'edits' a list of 1 to {MAX_EDITS} edits. Got {got} instead.")
    if not _integer(top_k) or not 1 <= top_k <= MAX_TOP_K:
        raise InvalidArgumentError(f"Expected 'top_k' an integer in [1, {MAX_TOP_K}]. Got {top_k!r} instead.")
    return [_edit(e, k) for k, e in enumerate(edits)], int(top_k)


def _keys(what: str, obj: Mapping[str, Any], allowed: set[str], required: set[str]) -> None:
    unknown, missing = sorted(set(obj) - allowed, key=str), sorted(required - set(obj))
    if unknown or missing:
        got = ", ".join([*(f"unknown {str(k)[:40]!r}" for k in unknown), *(f"no {k!r}" for k in missing)])
        raise InvalidArgumentError(f"Expected a {what} with the keys {', '.join(sorted(allowed))} "
                                   f"({', '.join(sorted(required))} required). Got {got} instead.")


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _edit(e: Any, k: int) -> Edit:
    if not isinstance(e, Mapping):
        raise InvalidArgumentError(f"Expected edit {k} a JSON object. Got {type(e).__name__} instead.")
    _keys(f"edit ({k})", e, EDIT_KEYS, EDIT_KEYS - {"value", "mode"})
    for name in ("kind", "mode"):
        if name in e and not isinstance(e[name], str):
            raise InvalidArgumentError(f"Expected edit {k}'s {name!r} a string. Got {e[name]!r:.40} instead.")
    for name in ("layer", "index", "position"):
        if not _integer(e[name]):
            raise InvalidArgumentError(f"Expected edit {k}'s {name!r} an integer. Got {e[name]!r:.40} instead.")
    value = e.get("value")
    if isinstance(value, list) and len(value) > MAX_VALUE_LENGTH:
        raise InvalidArgumentError(f"Expected edit {k}'s 'value' at most {MAX_VALUE_LENGTH} numbers. Got "
                                   f"{len(value)} instead.")
    return Edit(e["kind"], e["layer"], e["index"], e["position"], e.get("mode", "zero"), value)


class Interventions:
    """Answers intervention requests (:func:`parse_request`) on one prompt (its token ids ``ids``) with one loaded
    engine, one at a time (the hooks are the model's own state)."""

    def __init__(self, engine: Any, ids: Sequence[int]) -> None:
        self.engine, self.ids = engine, list(ids)
        self._lock = threading.Lock()

    def __call__(self, body: Any) -> dict[str, Any]:
        """The answer to one request body: its :meth:`~detjac.engine.tools.intervene.Intervention.to_dict` and the
        model's name.

        Raises
        ------
        InvalidArgumentError, UnsupportedModelError
            A malformed request, or an edit the model refuses (out of range), before any work.
        """
        edits, top_k = parse_request(body)
        with self._lock:
            result = intervene(self.engine, self.ids, edits, top_k=top_k)
        return {**result.to_dict(), "model": str(getattr(getattr(self.engine, "model_ref", None), "name", ""))}


def load_interventions(model: str, prompt: str, tokens: Sequence[str], known_ids: Mapping[int, int],
                       **load: Any) -> Interventions:
    """The engine of ``model`` loaded once (:func:`detjac.engine.load_engine` with ``load``), answering for the
    graph's prompt: ``prompt`` (its text), ``tokens`` (its token texts) and ``known_ids`` (position -> token id, where
    the graph records it).

    Raises
    ------
    InvalidArgumentError
        The model tokenizes the prompt into other tokens than the graph's: another model's graph.
    CheckpointError
        ``model`` names nothing loadable.
    """
    engine = load_engine(model, **load)
    complete = sorted(known_ids) == list(range(len(tokens)))  # every token kept: the ids as the graph was made
    ids = engine.token_ids([known_ids[k] for k in range(len(tokens))] if complete else prompt)
    texts = token_labels(engine.tokenizer, ids)
    if texts != list(tokens) or any(k >= len(ids) or ids[k] != v for k, v in known_ids.items()):
        raise InvalidArgumentError(f"Expected a model that reads the graph's prompt as its {len(tokens)} tokens "
                                   f"({''.join(tokens)[:60]!r}). Got {len(ids)} other tokens from {model}: the graph "
                                   "is of another model.")
    return Interventions(engine, ids)
