"""The page's files, shipped inside the package (``static/``): nothing is fetched from the network."""

from __future__ import annotations

from importlib import resources

ASSETS = {"app.js": "text/javascript", "charts.js": "text/javascript", "graph_page.js": "text/javascript",
          "style.css": "text/css"}
MODES = ("server", "static")


def asset(name: str) -> bytes:
    """One of :data:`ASSETS`, as shipped."""
    return resources.files(__package__).joinpath("static", name).read_bytes()


def index_html(mode: str) -> bytes:
    """The page, for the server (``server``: data from ``api/``) or a static snapshot (``static``: ``data/``)."""
    if mode not in MODES:
        raise ValueError(f"Expected a mode among {', '.join(MODES)}. Got {mode!r}.")
    return asset("index.html").replace(b"__MODE__", mode.encode())
