"""The ``graph-metadata.json`` index circuit-tracer's server reads: the graphs of a folder, one metadata object each
(torch-free; written by ``detjac graph --out`` and ``detjac store export``).

Its server answers ``/graph_data/SLUG.json`` from the folder, so a graph's file is named after its slug
(:func:`slug_of`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .safe_json import read_json

INDEX_NAME = "graph-metadata.json"


def slug_of(path: str | Path) -> str:
    """The slug a graph written to ``path`` is listed under: the file's name without ``.json``."""
    return Path(path).stem


def updated_index(folder: str | Path, metadata: dict[str, Any]) -> str:
    """The text of ``folder``'s index with ``metadata`` listed (replacing an entry of the same slug); an index that
    does not read as one (unreadable, not JSON, no ``graphs`` list) is started anew."""
    index_path = Path(folder) / INDEX_NAME
    graphs: list[Any] = []
    if index_path.is_file():
        try:
            loaded = read_json(index_path)
        except (OSError, ValueError):
            loaded = None
        if isinstance(loaded, dict) and isinstance(loaded.get("graphs"), list):
            graphs = loaded["graphs"]
    slug = metadata.get("slug")
    kept = [g for g in graphs if isinstance(g, dict) and g.get("slug") != slug]
    return json.dumps({"graphs": [*kept, metadata]}, indent=1)
