"""``detjac view graph.json``: the pages of one graph JSON file written by ``detjac graph`` (no store)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from ..safe_json import read_json
from .graph_page import graph_payload
from .pages import NotFound


class GraphFile:
    """The pages of one graph JSON file (``detjac view graph.json``): ``corpus`` (what the header shows, and that
    the page is a graph's) and ``graph``; the same interface as :class:`~detjac.view.pages.Pages` for the
    server and the static export. The file is read and checked once.

    Raises
    ------
    InvalidArgumentError
        The file cannot be read as a graph JSON.
    """

    GRAPH_KEY = "graph"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            raw = read_json(self.path)
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(f"Expected a graph JSON file written by `detjac graph`. Got {self.path}, "
                                       f"which cannot be read as JSON ({exc}).") from exc
        self.graph = graph_payload(raw, str(self.path))

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
        raise NotFound(key)

    def keys(self, prompt_ids: list[str] | None = None) -> list[str]:
        return ["corpus", self.GRAPH_KEY]
