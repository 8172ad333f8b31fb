"""``detjac view graph.json``: the pages of one graph JSON file written by ``detjac graph`` (no store), and the
attention pages of the ``detjac attention`` files given with it (``--attention``) or found beside it
(``<graph stem>.qk.*.json``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from ..safe_json import read_json
from .attention_file import check_belongs, link_attention, page_key, read_attention
from .graph_page import graph_payload
from .pages import NotFound


def beside(path: Path) -> list[Path]:
    """The attention files found beside the graph ``path`` by name: ``<stem>.qk.*.json``, sorted."""
    return sorted(path.parent.glob(f"{glob_escape(path.stem)}.qk.*.json"))


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


class GraphFile:
    """The pages of one graph JSON file (``detjac view graph.json``): ``corpus`` (what the header shows, and that
    the page is a graph's) and ``graph``; the same interface as :class:`~detjac.view.pages.Pages` for the
    server and the static export. The file is read and checked once.

    Raises
    ------
    InvalidArgumentError
        The file cannot be read as a graph JSON; an attention file cannot be read as ``detjac attention``'s JSON,
        is of another model or prompt than the graph's, or repeats another's head and query position.
    """

    GRAPH_KEY = "graph"

    def __init__(self, path: str | Path, attention: Sequence[str | Path] = ()) -> None:
        self.path = Path(path)
        try:
            raw = read_json(self.path, kind="graph")
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(f"Expected a graph JSON file written by `detjac graph`. Got {self.path}, "
                                       f"which cannot be read as JSON ({exc}).") from exc
        self.graph = graph_payload(raw, str(self.path))
        info = raw.get("metadata", {}).get("info") if isinstance(raw.get("metadata"), dict) else None
        self.attention: dict[str, dict[str, Any]] = {}
        heads: dict[tuple[int, int, int], str] = {}
        found: dict[Path, Path] = {}  # each file once, however named; read and named by the path given
        for given in [*map(Path, attention), *beside(self.path)]:
            found.setdefault(given.resolve(), given)
        files = list(found.values())
        for file in files:
            qk = read_attention(file)
            check_belongs(qk, self.graph, info if isinstance(info, dict) else {}, str(file))
            key = page_key(qk["layer"], qk["head"], qk["query_position"])
            if key in self.attention:
                raise InvalidArgumentError(f"Expected one attention file per head and query position. Got two for "
                                           f"layer {qk['layer']} head {qk['head']} at {qk['query_position']}: "
                                           f"{files[[*self.attention].index(key)]} and {file}.")
            self.attention[key] = {**qk, "key": key, "file": file.name}
            heads[(qk["layer"], qk["head"], qk["query_position"])] = key
        link_attention(self.graph, heads, self.path.stem)
        meta = self.graph["metadata"]
        shared = {"nodes": [n["id"] for n in self.graph["nodes"] if n["type"] != "logit"],  # not its links: small
                  "attention": meta["attention"], "attention_command": meta["attention_command"]}
        for page in self.attention.values():
            page["graph"] = shared

    def __len__(self) -> int:
        return 1

    def prompt_ids(self) -> list[str]:
        return []

    def refresh(self) -> bool:
        return False  # read once: a file rewritten later is shown after a restart

    def data(self, key: str) -> dict[str, Any]:
        if key == "corpus":
            info = self.graph["metadata"]["info"]
            run = {"model_id": info.get("model"), "family": info.get("family"), "dtype": info.get("dtype")}
            return {"store": {"name": self.path.name, "created": None, "format_version": None,
                              "run": {k: v for k, v in run.items() if v is not None}},
                    "prompts": [], "failures": [], "graph": self.GRAPH_KEY}
        if key == self.GRAPH_KEY:
            return self.graph
        if key in self.attention:
            return self.attention[key]
        raise NotFound(key)

    def keys(self, prompt_ids: list[str] | None = None) -> list[str]:
        return ["corpus", self.GRAPH_KEY, *sorted(self.attention)]
