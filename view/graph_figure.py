"""A figure of a graph (``static/graph_figure.js``): the pinned nodes a graph JSON carries in circuit-tracer's and
Neuronpedia's ``qParams.pinnedIds``, checked, so that the page opens with them pinned.

The page pins nodes, keeps the subgraph of the pinned nodes and their links, groups neurons by hand into supernodes,
saves that state as a new graph JSON (``qParams.pinnedIds`` and ``qParams.supernodes``: a file the browser downloads;
nothing is written by ``detjac view``) and exports a labelled SVG. Opening the saved file restores it: its pins here,
its supernodes as groups (:mod:`~detjac.view.graph_groups`, the same rule for a group made by hand).
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgumentError


def parse_pins(qparams: Any, nodes: list[dict[str, Any]], where: str) -> list[str]:
    """``qParams.pinnedIds`` checked against the page's ``nodes``: the pinned node ids, each once, in the file's
    order (none without ``qParams`` or ``pinnedIds``).

    Raises
    ------
    InvalidArgumentError
        ``pinnedIds`` is not a list of node ids of this graph.
    """
    pins = qparams.get("pinnedIds") if isinstance(qparams, dict) else None
    if pins is None:
        return []
    known = {n["id"] for n in nodes}
    bad = next((p for p in pins if not isinstance(p, str) or p not in known), None) if isinstance(pins, list) \
        else pins
    if bad is not None:
        raise InvalidArgumentError(f"Expected qParams.pinnedIds of {where} to be a list of its node ids. Got "
                                   f"{str(bad)[:60]!r}.")
    return list(dict.fromkeys(pins))


def pinned_page(page: dict[str, Any], qparams: Any, where: str) -> dict[str, Any]:
    """``page`` (:func:`~detjac.view.graph_page.graph_payload`) with ``pinned``: :func:`parse_pins` of
    ``qparams`` (``[]`` without pins)."""
    return {**page, "pinned": parse_pins(qparams, page["nodes"], where)}
