"""``detjac view``: a read-only local web viewer of a store (torch-free; above the analyses, below the CLI).

``readonly``: the store as the analyses see it, their results kept in memory, never written;
``corpus_page``, ``prompt_page``, ``layers_page``, ``graph_page``: what each page shows, as JSON-ready dicts
computed with :mod:`detjac.analysis` (a graph: as ``detjac graph`` wrote it);
``graph_file``: the pages of one graph JSON file;
``pages``: every page's data by key; ``server``: the local HTTP server (standard library only);
``static_export``: the same pages as a static snapshot that opens from disk; ``static/``: the page itself (plain HTML,
CSS and JavaScript with hand-drawn SVG charts and graphs, nothing fetched from the network).
"""

from typing import TYPE_CHECKING

from detjac.facade import lazy_exports

if TYPE_CHECKING:  # the façade's names, each once: read by type checkers and by lazy_exports (imported on first use)
    from .attention_file import graph_token_ids
    from .attention_heads import TopHeads, top_heads
    from .graph_file import GraphFile
    from .server import make_server
    from .static_export import export_static

__all__, __getattr__ = lazy_exports(__name__, __file__)
