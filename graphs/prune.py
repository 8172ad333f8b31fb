"""Pruning an attribution graph by influence on the logits, as circuit-tracer defines it (so graphs compare).

A node's influence is its total weight on the logits through every path of the row-normalised ``|adjacency|``,
each logit weighted by its probability; nodes are kept until ``node_threshold`` of the total influence, then edges
(scored on the pruned graph) until ``edge_threshold``; tokens and logits are always kept, and neurons left with no
edge in or out are dropped. Details: docs/graphs.md, "Pruning"."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from detjac.errors import InvalidArgumentError
from detjac.graph_settings import EDGE_THRESHOLD, NODE_THRESHOLD


@dataclass
class Pruned:
    """Which nodes and edges of a graph are kept, and each node's cumulative influence score."""

    nodes: np.ndarray  # (N,) bool
    edges: np.ndarray  # (N, N) bool, [target, source]
    cumulative: np.ndarray  # (N,) the share of total influence held by the nodes at least as influential


PRUNE_BYTES_PER_ENTRY = 18  # what pruning holds beside the adjacency, per entry (see :func:`prune_bytes`)
_CHUNK = 1 << 16  # scores summed per step when a threshold is sought


def prune_bytes(size: int) -> int:
    """Bytes :func:`prune` holds at its peak beside the ``(size, size)`` float64 adjacency itself: one normalised
    copy (the edge scores, 8 bytes an entry), their sorted copy (8) and two masks (1 each), plus the scores' vectors
    and a threshold's running sums (a chunk's)."""
    return PRUNE_BYTES_PER_ENTRY * size * size + 128 * size + 2 * 8 * min(_CHUNK + 1, size * size) + 1024


def normalised(adjacency: np.ndarray) -> np.ndarray:
    """``|A|`` with each row (a target's incoming edges) scaled to sum to 1 (rows of zeros stay zero); one new
    array, scaled in place."""
    a = np.abs(adjacency)
    a /= np.maximum(a.sum(axis=1, keepdims=True), 1e-10)
    return a


def influence(a: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``w (A + A^2 + ...)``: each node's total weight on the weighted targets. ``A`` is a DAG's (nilpotent)."""
    current = weights @ a
    total = current.copy()
    for _ in range(a.shape[0] + 1):
        if not current.any():
            return total
        current = current @ a
        total += current
    raise InvalidArgumentError("Expected an acyclic adjacency (a graph whose edges go up the layers). Got a cycle.")


def threshold(scores: np.ndarray, keep: float) -> float:
    """The score above which the highest scores hold ``keep`` of their total. Holds one sorted copy of ``scores``;
    the running share is summed a chunk at a time, each chunk continuing the previous one's last sum, so it is the
    sequential ``cumsum`` to the last bit."""
    ordered = np.sort(scores)[::-1]
    total = ordered.sum()
    if total <= 0:
        return float(ordered[-1]) if ordered.size else 0.0
    carry = ordered.dtype.type(0)
    for start in range(0, ordered.size, _CHUNK):
        cumulative = np.cumsum(np.concatenate([[carry], ordered[start:start + _CHUNK]]))[1:]
        carry = cumulative[-1]
        cumulative /= total
        if cumulative[-1] >= keep:
            return float(ordered[start + int(np.searchsorted(cumulative, keep))])
    return float(ordered[-1])


def prune(adjacency: np.ndarray, n_neurons: int, n_tokens: int, logit_probabilities: np.ndarray,
          node_threshold: float = NODE_THRESHOLD, edge_threshold: float = EDGE_THRESHOLD) -> Pruned:
    """Keep the nodes and edges that carry the logits (see the module docstring). Nodes are ordered neurons
    (``n_neurons``), tokens (``n_tokens``), logits (the rest).

    Raises
    ------
    InvalidArgumentError
        A threshold outside [0, 1].
    """
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= value <= 1.0:
            raise InvalidArgumentError(f"Expected {name} in [0, 1]. Got {value!r}.")
    size, n_logits = adjacency.shape[0], len(logit_probabilities)
    fixed = size - n_logits - n_tokens  # tokens and logits from here on
    weights = np.zeros(size)
    weights[size - n_logits:] = logit_probabilities
    a = normalised(adjacency)  # one (N, N) array at a time beside the adjacency: prune_bytes counts them
    node_score = influence(a, weights)
    del a
    nodes = node_score >= threshold(node_score, node_threshold)
    nodes[fixed:] = True
    a = np.abs(adjacency)  # the kept nodes' edges, normalised, then scaled into the edge scores in place
    a[~nodes] = 0
    a[:, ~nodes] = 0
    nonzero = a != 0
    a /= np.maximum(a.sum(axis=1, keepdims=True), 1e-10)
    a *= (influence(a, weights) + weights)[:, None]
    edges = a >= threshold(a.ravel(), edge_threshold)
    del a
    edges &= nonzero
    del nonzero
    while True:  # neurons with no edge out, or none in, go; which may strand others
        before = nodes.copy()
        edges[~nodes] = False
        edges[:, ~nodes] = False
        nodes[:fixed] &= edges[:, :fixed].any(axis=0)
        nodes[:n_neurons] &= edges[:n_neurons].any(axis=1)
        if (nodes == before).all():
            break
    order = np.argsort(-node_score, kind="stable")
    cumulative = np.zeros(size)
    total = node_score.sum()
    cumulative[order] = np.cumsum(node_score[order]) / (total if total > 0 else 1.0)
    return Pruned(nodes, edges, cumulative)
