"""A graph's supernodes (circuit-tracer's ``qParams.supernodes``, as ``detjac graph --group`` writes them) as the
graph page draws them: each group one node at its layer, collapsed until a click expands it into its members.

A group is a node like any other because its members share a layer and no neuron feeds another of its own layer: its
value is the sum of its members' values and each of its links the sum of its members' links to (or from) the same
node, so a node's incoming links still sum to its value (completeness holds, the members' errors added). The sums
are computed here, in float64 (``math.fsum``: the correctly rounded sum), never in the page.

For every link of the graph with a grouped end, :func:`group_links` writes the link each drawing can need: to (or
from) the group in place of its member, and, where both ends are grouped, between the two groups. Whichever groups
are collapsed, each link of the graph is drawn exactly once: as the link whose two ends are both drawn. The page
only chooses which nodes are drawn (:func:`drawn`, the same rule as ``static/graph_groups.js``).

What is not exact: a group's ``influence`` is its most influential member's (the node filter keeps a group while it
keeps any member), and its position the position of that member (a group's members may sit at several positions).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from ..errors import InvalidArgumentError
from ..graph_nodes import NEURON

GROUP = "group"
PREFIX = "G_"  # a group's node id: G_0, G_1, ... (no circuit-tracer id starts so)
MEANING = ("A group (supernode) is drawn as one node at its layer: its value is its members' sum and its links the "
           "sums of their links, exactly (a layer's neurons never feed each other, so a group's incoming links "
           "still sum to its value). Click a group to expand it into its members; collapse it again from the list.")


def parse_supernodes(supernodes: Any, nodes: list[dict[str, Any]], where: str
                     ) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """``qParams.supernodes`` (``[[name, node id, ...], ...]``) checked against the page's ``nodes``: (the groups
    drawn collapsed, each its name and member ids; why each other group is not). A group is drawn collapsed only where
    that is exact: two or more neurons of the graph, of one layer, in no earlier group. Another (a hand-made group
    across layers, say, or one naming a node this graph pruned) is left expanded, its reason listed.

    Raises
    ------
    InvalidArgumentError
        ``supernodes`` is not a list of ``[name, node id, node id, ...]``, or a node id starts with ``G_`` (the
        viewer's group ids).
    """
    expected = (f"Expected qParams.supernodes of {where} to be a list of [name, node id, node id, ...] (as `detjac "
                "graph --group` writes).")
    if not isinstance(supernodes, list):
        raise InvalidArgumentError(f"{expected} Got {type(supernodes).__name__}.")
    by_id = {n["id"]: n for n in nodes}
    clash = next((i for i in by_id if i.startswith(PREFIX)), None)
    if clash is not None:
        raise InvalidArgumentError(f"Expected no node id of {where} to start with {PREFIX!r} (the viewer's group "
                                   f"ids) when it has supernodes. Got {clash[:40]!r}.")
    taken: dict[str, int] = {}
    groups, skipped = [], []
    for k, group in enumerate(supernodes):
        if not isinstance(group, list) or len(group) < 3 or not all(isinstance(x, str) for x in group):
            raise InvalidArgumentError(f"{expected} Got group {k}: {str(group)[:200]}.")
        name, members = group[0], list(dict.fromkeys(group[1:]))
        unknown = [m for m in members if m not in by_id or by_id[m]["type"] != NEURON.name]
        layers = sorted({by_id[m]["layer"] for m in members if m not in unknown})
        again = [m for m in members if m in taken]
        if unknown or len(layers) != 1 or again or len(members) < 2:
            why = (f"{unknown[0][:40]!r} is no neuron of this graph" if unknown
                   else f"{again[0][:40]!r} is also in group {taken[again[0]]}" if again
                   else f"neurons of layers {', '.join(layers)}" if len(layers) != 1 else "one member")
            skipped.append(f"group {k} ({name[:60]}): {why}")
            continue
        taken.update(dict.fromkeys(members, k))
        groups.append((name, members))
    return groups, skipped


def group_nodes(groups: list[tuple[str, list[str]]], nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One node per group, as the page draws nodes (``id`` ``G_k``, ``type`` ``group``), with its ``members`` (ids),
    ``size``, ``name``, ``activation`` (the members' sum, or None where one has none), ``influence`` and ``ctx``
    (its most influential member's) and its ``clerp``: ``NAME (N neurons)``."""
    by_id = {n["id"]: n for n in nodes}
    out = []
    for k, (name, members) in enumerate(groups):
        rows = [by_id[m] for m in members]
        first = min(rows, key=lambda n: math.inf if n["influence"] is None else n["influence"])
        values = [n["activation"] for n in rows]
        out.append({"id": f"{PREFIX}{k}", "type": GROUP, "layer": first["layer"], "row": first["row"],
                    "ctx": first["ctx"], "activation": None if None in values else math.fsum(values),
                    "influence": first["influence"], "clerp": f"{name} ({len(members)} neurons)", "name": name,
                    "p": None, "token": None, "drivers": None, "members": members, "size": len(members)})
    return out


def group_links(groups: list[tuple[str, list[str]]], links: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The links a drawing with groups can need (see the module docstring): for each link with a grouped end, the
    link from (or to) its group in place of the member, and between both groups where both ends are grouped; links
    of the same ends summed (``math.fsum``). Each: ``source``, ``target``, ``weight``, ``parts`` (links summed)."""
    of = {m: f"{PREFIX}{k}" for k, (_, members) in enumerate(groups) for m in members}
    sums: dict[tuple[str, str], list[float]] = {}
    for link in links:
        s, t = link["source"], link["target"]
        gs, gt = of.get(s), of.get(t)
        ends = [(gs, t)] if gs else []
        if gt:
            ends += [(s, gt)] + ([(gs, gt)] if gs else [])
        for end in ends:
            sums.setdefault(end, []).append(link["weight"])
    return [{"source": s, "target": t, "weight": math.fsum(w), "parts": len(w)} for (s, t), w in sums.items()]


def grouped_page(page: dict[str, Any], supernodes: Any, where: str) -> dict[str, Any]:
    """``page`` (:func:`~detjac.view.graph_page.graph_payload`) with ``groups``: ``{nodes, links, meaning, skipped}``
    (:func:`group_nodes`, :func:`group_links`; the note names each group not drawn collapsed, and why, even when
    none is); unchanged where ``supernodes`` is empty or missing."""
    groups, skipped = parse_supernodes(supernodes, page["nodes"], where) if supernodes else ([], [])
    if not groups and not skipped:
        return page
    note = (f" Not drawn collapsed (only neurons of one layer make an exact group): {'; '.join(skipped)}."
            if skipped else "")
    return {**page, "groups": {"nodes": group_nodes(groups, page["nodes"]),
                               "links": group_links(groups, page["links"]), "meaning": MEANING + note,
                               "skipped": skipped}}


def drawn(page: dict[str, Any], expanded: Iterable[str] = ()) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The nodes and links drawn with the groups ``expanded`` (ids) open and the others collapsed: a collapsed
    group's node in place of its members, an expanded group's members in place of it; the links whose two ends are
    drawn. The page's own rule (``static/graph_groups.js``), written once more here to be tested."""
    groups = page.get("groups") or {"nodes": [], "links": []}
    opened = set(expanded)
    hidden = {m for g in groups["nodes"] if g["id"] not in opened for m in g["members"]} | opened
    nodes = [n for n in [*page["nodes"], *groups["nodes"]] if n["id"] not in hidden]
    shown = {n["id"] for n in nodes}
    links = [x for x in [*page["links"], *groups["links"]] if x["source"] in shown and x["target"] in shown]
    return nodes, links
