"""Graph JSON files and the ``graph-metadata.json`` index circuit-tracer's server reads (the graphs of a folder, one
metadata object each): :func:`write_graph_file` is the one writer of both, for ``detjac graph --out`` (the engine's
:func:`~detjac.graphs.write_graph`) and ``detjac store export`` (the store's ``export_graph``). Torch-free.

Its server answers ``/graph_data/SLUG.json`` from the folder, so a graph's file is named after its slug
(:func:`slug_of`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .aside import keep_elsewhere, reason_of
from .errors import OutputError
from .outputs import write_output
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


def write_graph_file(path: str | Path, graph: dict[str, Any]) -> Path:
    """Write the graph JSON object ``graph`` to ``path`` and list its ``metadata`` in the index beside it.

    Each file is written beside itself, flushed to disk and renamed into place: a kill or a full disk leaves the
    previous file (or none), never a truncated one.

    Parameters
    ----------
    path : str or Path
        The graph's ``.json`` file, in an existing folder (checked by the caller).
    graph : dict
        A graph JSON object (circuit-tracer's schema), its ``metadata.slug`` already set.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    OutputError
        The file system refused a write (a full disk): nothing half-written is left, and the graph, which may have
        taken long to compute, is kept where there is room (the message says where).
    """
    path = Path(path)
    text, kept = json.dumps(graph), None
    try:
        write_output(path, text)
        kept = path
        write_output(path.parent / INDEX_NAME, updated_index(path.parent, graph["metadata"]))
    except OSError as exc:
        kept = kept or keep_elsewhere(path, text.encode())
        raise OutputError(f"Expected to write the graph to {path} and list it in {INDEX_NAME}. Got {reason_of(exc)}; "
                          + (f"the graph is kept in {kept}." if kept else "it could not be kept elsewhere either.")
                          ) from exc
    return path

