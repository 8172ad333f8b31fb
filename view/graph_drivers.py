"""What drives a node of an attribution graph: the upstream nodes through which most of what reaches it flows.

Definition (the graph page's "what drives it" view; docs/graphs.md, "In the viewer"). Let ``W[t, s]`` be the weight
of the link ``s -> t`` of the graph as shown (the pruned JSON), and ``A`` its row-normalised magnitude:
``A[t, s] = |W[t, s]| / sum_s' |W[t, s']|`` (each node's incoming |weight| as shares; a node without incoming links
has a zero row). The **driver share** of ``s`` for ``t`` is

    D[t, s] = sum_{k >= 1} (A^k)[t, s],

the share of ``t``'s incoming |weight| that passes through ``s``, summed over every path from ``s`` to ``t``: its
direct share plus, for every node in between, its share of that node's share. It is circuit-tracer's influence
(which ranks nodes for pruning, seen from all logits at once) seen from one node. Each ``D[t, s]`` lies in [0, 1];
over the tokens (where every path starts) it sums to 1 for any ``t`` with an upstream. The drivers of ``t`` are its
:data:`DRIVERS` nodes of largest ``D[t, s]``.

Links only run from lower to higher layers, so the graph is acyclic and ``D`` is computed one topological level at a
time, from the top down (``targets x nodes`` numbers in memory, never ``A`` whole): a flow starts at 1 on each
target; a level's nodes hand their whole flow on to their sources in the shares of ``A``, link by link, so the cost
is ``targets x links`` multiply-adds. A graph too large for that gets its drivers computed for the logits and the
most influential nodes until :data:`WORK` multiply-adds are spent (about a second), the rest are listed as not
computed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidArgumentError

DRIVERS = 12  # drivers listed per node
WORK = 3e8  # multiply-adds spent on driver shares per graph: every node of a graph of up to ~7,000 nodes, 5 links each
DRIVERS_MEANING = (
    "What drives a node: the nodes through which most of what reaches it flows. A node's driver share is the share "
    "of its incoming |weight| (each node's incoming links as shares of their total |weight|) that passes through the "
    "driver, summed over every path from the driver to it; over the tokens, where every path starts, the shares sum "
    f"to 1. The drivers of a node are its {DRIVERS} upstream nodes of largest share; the rest of the graph is faded. "
    "A share ranks unsigned flow, not a signed effect on the target: the signed contribution of each token is in "
    "the target panel, and a node's direct weight is in the last column.")


def levels(n: int, sources: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """(n,) each node's topological level: 0 for a node without incoming links, else one more than its highest
    source's (the longest path into it).

    Raises
    ------
    InvalidArgumentError
        The links hold a cycle (an attribution graph never does).
    """
    level = np.zeros(n, dtype=np.int64)
    for _ in range(n + 1):
        new = level.copy()
        np.maximum.at(new, targets, level[sources] + 1)
        if np.array_equal(new, level):
            return level
        level = new
    raise InvalidArgumentError("Expected an attribution graph without cycles (links from lower to higher layers). "
                               "Got links that lead back to their own source.")


def driver_shares(n: int, sources: np.ndarray, targets: np.ndarray, weights: np.ndarray,
                  wanted: np.ndarray) -> np.ndarray:
    """(len(wanted), n) ``D[t, s]`` (module docstring) for each node ``t`` of ``wanted``.

    Parameters
    ----------
    n : int
        Nodes of the graph.
    sources, targets : (links,) int arrays
        Each link's ends (node indices).
    weights : (links,) float array
        Each link's weight (signed; only its magnitude counts).
    wanted : (m,) int array
        The nodes whose drivers are asked for.
    """
    level = levels(n, sources, targets)
    magnitude = np.abs(weights.astype(np.float64))
    incoming = np.bincount(targets, weights=magnitude, minlength=n)
    share = magnitude / np.where(incoming[targets] > 0, incoming[targets], 1.0)  # A[t, s] of each link
    flow = np.zeros((len(wanted), n))
    flow[np.arange(len(wanted)), wanted] = 1.0
    # links grouped by their target's level, and within a level by source: one level's hand-on is a gather, a
    # product and a segment sum, ``wanted x links`` multiply-adds over all levels (a pruned graph has far fewer links
    # than nodes squared)
    by_level = np.lexsort((sources, level[targets]))
    bounds = np.searchsorted(level[targets][by_level], np.arange(level.max(initial=0) + 2))
    for lv in range(level.max(initial=0), 0, -1):  # the top level first: its flow is complete when handed on
        links = by_level[bounds[lv]:bounds[lv + 1]]
        if links.size == 0:
            continue
        handed = flow[:, targets[links]] * share[links]  # (wanted, links): what each link carries down
        src = sources[links]
        starts = np.flatnonzero(np.r_[True, src[1:] != src[:-1]])  # sorted by source within the level
        flow[:, src[starts]] += np.add.reduceat(handed, starts, axis=1)
    flow[np.arange(len(wanted)), wanted] -= 1.0  # D excludes the empty path
    return flow


def node_drivers(nodes: list[dict[str, Any]], links: list[dict[str, Any]], k: int = DRIVERS,
                 work: float = WORK) -> tuple[list[list[list[float]] | None], int]:
    """Each node's drivers, as the graph page gets them: ``[[node index, share], ...]`` largest share first (at most
    ``k``, shares above 0), or None where not computed (a token: nothing is upstream; a node beyond the budget).

    Parameters
    ----------
    nodes : list of dict
        The page's nodes (:func:`~detjac.view.graph_page.graph_payload`): ``id``, ``type``, ``influence``.
    links : list of dict
        The page's links: ``source``, ``target`` (node ids), ``weight``.
    k : int
        Drivers per node.
    work : float
        Multiply-adds to spend: the logits first, then the other nodes by influence (most influential first) while
        ``targets x (nodes + links)`` stays within it.

    Returns
    -------
    (drivers, computed)
        One entry per node, and how many nodes have their drivers computed.
    """
    n = len(nodes)
    index = {node["id"]: i for i, node in enumerate(nodes)}
    sources = np.asarray([index[x["source"]] for x in links], dtype=np.int64)
    targets = np.asarray([index[x["target"]] for x in links], dtype=np.int64)
    weights = np.asarray([x["weight"] for x in links], dtype=np.float64)
    has_upstream = np.bincount(targets, minlength=n) > 0
    order = sorted((i for i in range(n) if has_upstream[i]),
                   key=lambda i: (nodes[i]["type"] != "logit", nodes[i]["influence"] is None,
                                  nodes[i]["influence"] or 0.0, i))
    budget = max(sum(nodes[i]["type"] == "logit" for i in order), int(work // max(1, n + len(links))))
    wanted = np.asarray(order[:budget], dtype=np.int64)
    out: list[list[list[float]] | None] = [None] * n
    if wanted.size == 0:
        return out, 0
    shares = driver_shares(n, sources, targets, weights, wanted)
    for row, t in zip(shares, wanted.tolist(), strict=True):
        top = np.argsort(-row, kind="stable")[:k]
        out[t] = [[int(s), float(row[s])] for s in top if row[s] > 0]
    return out, int(wanted.size)
