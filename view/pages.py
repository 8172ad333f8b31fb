"""Every page's data by key, for the server and the static export alike.

A key names what one page (or part of one) shows: ``corpus``, ``prompt/<id>``,
``prompt/<id>/operator/<k>`` (token ``k``'s ``J_k``, or ``combined`` for ``[J_1 ... J_n]``),
``prompt/<id>/layers/<kind>`` and ``prompt/<id>/graph`` (its attribution graph, where the store keeps
one). A key is only ever looked up, never used as a path: the prompt id must be one of the store's
complete prompts, the token an index of that prompt, the kind one of its layerwise kinds, a graph
one the prompt has; anything else is :class:`NotFound`. Results are kept in memory
(prompts do not change once committed), and one page is computed at a time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..numerals import parse_index
from .corpus_page import Corpus
from .graph_page import graph_payload, stored_graph
from .layers_page import layers_payload
from .prompt_page import layer_kinds, operator_payload, prompt_payload
from .readonly import ReadOnlyStore

if TYPE_CHECKING:
    from ..store import StoreReader

KEPT_PAGES = 256  # pages kept in memory, least recently used dropped first


def _root_seal(path: Any) -> str:
    """The root's seal: the SHA-256 of its description (run, creation time, model digests), changed by nothing
    but a new store in the folder."""
    from pathlib import Path

    from detjac.store import INTEGRITY, read_root

    root = read_root(Path(path))
    return str(root.get(INTEGRITY, {}).get("attrs_sha256") or root.get("created"))


class NotFound(LookupError):
    """No page has this key."""


class Pages:
    """The pages of one store (opened for reading), by key (see the module docstring)."""

    def __init__(self, store: StoreReader) -> None:
        self._compute = threading.Lock()
        self._open(store)

    def _open(self, store: StoreReader) -> None:
        self.view = ReadOnlyStore(store)
        self.corpus = Corpus(self.view)
        self._kept: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.path = getattr(store, "path", None)
        self.seal = _root_seal(self.path) if self.path is not None else None

    def refresh(self) -> bool:
        """Re-check that the folder still holds the store these pages were read from (its root seal: one small
        file read), and reopen it if another store took its place (``detjac run --force-new``): pages are never
        computed from one store's prompts with another's model. Returns whether it was reopened.

        Raises
        ------
        StoreError
            The folder no longer holds a readable store (removed, or damaged).
        """
        if self.path is None:
            return False
        with self._compute:
            seal = _root_seal(self.path)
            if seal == self.seal:
                return False
            from detjac.store import open_store

            self._open(open_store(self.path))
            return True

    def data(self, key: str) -> dict[str, Any]:
        """The data of page ``key``.

        Raises
        ------
        NotFound
            ``key`` names no page of this store.
        """
        if key == "corpus":
            return self.corpus.payload()
        return self._kept_or(key, self._page(key.split("/")))

    def _page(self, parts: list[str]) -> Callable[[], dict[str, Any]]:
        if len(parts) < 2 or parts[0] != "prompt" or parts[1] not in set(self.view.prompt_ids()):
            raise NotFound("/".join(parts))
        pid = parts[1]
        if len(parts) == 2:
            return lambda: prompt_payload(self.view, pid)
        if len(parts) == 4 and parts[2] == "operator":
            token = self._token(pid, parts[3])
            return lambda: operator_payload(self.view, pid, token)
        if len(parts) == 4 and parts[2] == "layers" and parts[3] in layer_kinds(self.view.get(pid)):
            return lambda: layers_payload(self.view, pid, parts[3])
        if len(parts) == 3 and parts[2] == "graph":
            return lambda: self._graph(pid)  # read once, then kept like every page
        raise NotFound("/".join(parts))

    def _graph(self, pid: str) -> dict[str, Any]:
        graph = stored_graph(self.view.get(pid))
        if graph is None:
            raise NotFound(f"prompt/{pid}/graph")
        return graph_payload(graph, f"the graph of prompt {pid}")

    def _token(self, pid: str, text: str) -> int | None:
        if text == "combined":
            return None
        token = parse_index(text, below=self.view.get(pid).n_tokens)
        if token is None:
            raise NotFound(f"prompt/{pid}/operator/{text}")
        return token

    def _kept_or(self, key: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        with self._compute:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
            page = compute()
            self._kept[key] = page
            while len(self._kept) > KEPT_PAGES:
                self._kept.popitem(last=False)
            return page

    def keys(self, prompt_ids: list[str] | None = None) -> Iterator[str]:
        """Every page's key (of ``prompt_ids`` only, when given): what a static export holds."""
        yield "corpus"
        for pid in self.view.prompt_ids() if prompt_ids is None else prompt_ids:
            prompt = self.view.get(pid)
            yield f"prompt/{pid}"
            if not prompt.without_jacobian:  # a --lens prompt has no operator to show
                yield f"prompt/{pid}/operator/combined"
                yield from (f"prompt/{pid}/operator/{k}" for k in range(prompt.n_tokens))
            yield from (f"prompt/{pid}/layers/{kind}" for kind in layer_kinds(prompt))
            if stored_graph(prompt) is not None:
                yield f"prompt/{pid}/graph"
