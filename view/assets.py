"""The page's files, shipped inside the package (``static/``): nothing is fetched from the network."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

ASSETS = {"app.js": "text/javascript", "charts.js": "text/javascript", "dom.js": "text/javascript",
          "graph_layout.js": "text/javascript", "graph_panels.js": "text/javascript",
          "graph_page.js": "text/javascript", "graph_heads.js": "text/javascript",
          "graph_groups.js": "text/javascript", "graph_figure.js": "text/javascript",
          "table_sort.js": "text/javascript", "graph_interventions.js": "text/javascript",
          "graph_target.js": "text/javascript",
          "attention_page.js": "text/javascript", "neuron_page.js": "text/javascript", "style.css": "text/css"}
MODES = ("server", "static")


def asset(name: str) -> bytes:
    """One of :data:`ASSETS`, as shipped."""
    return resources.files(__package__).joinpath("static", name).read_bytes()


def index_html(mode: str) -> bytes:
    """The page, for the server (``server``: data from ``api/``) or a static snapshot (``static``: ``data/``)."""
    if mode not in MODES:
        raise ValueError(f"Expected a mode among {', '.join(MODES)}. Got {mode!r}.")
    return asset("index.html").replace(b"__MODE__", mode.encode())


def data_script(key: str, data: Any, error: str | None = None) -> bytes:
    """A page's data as the script the page loads (``detjacData(key, data)``; with ``error``: ``detjacData(key, null,
    error)``). The page loads its data as scripts, served or from disk alike: a script inserted before the page's
    load event delays it, so a page is drawn completely when ``load`` fires (a ``fetch`` would not hold it)."""
    args = [json.dumps(key), json.dumps(None if error is not None else data, allow_nan=False)]
    if error is not None:
        args.append(json.dumps(error))
    return f"detjacData({', '.join(args)});\n".encode("ascii")
