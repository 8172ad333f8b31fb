"""Supernodes: a graph's neurons grouped where their neuron pages agree (``detjac graph --group``), exactly.

Two neurons of a graph join a group (single linkage, so a group is a connected set) when they are

- of the **same layer**: no neuron feeds another of its own layer, so a group has no edge inside it and is a node like
  any other: its value is the sum of its members' values, its incoming and outgoing links the sums of theirs, and
  its incoming edges over every source still sum to its value (the members' errors add; a logit's incoming edges are
  the same numbers summed in another grouping);
- **alike in what they read**: the token texts at their top positive contexts in the neuron index overlap (Jaccard
  at least :data:`CONTEXTS`): they fire on the same tokens of the corpus;
- **alike in what they write**: the tokens their write vectors raise most overlap (Jaccard at least :data:`WRITES`):
  they push the same logits.

Nothing is interpreted; the thresholds are conventions, stated. Positions are not compared: the same neuron at two
positions may join (its pages are the same page)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from detjac.store import NeuronIndex

CONTEXTS = 0.5
WRITES = 0.2


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


def group_neurons(index: NeuronIndex, neurons: np.ndarray) -> list[list[int]]:
    """Groups (of at least two rows of ``neurons``, (M, 3) layer, index, position) by the rule of the module
    docstring; each group's rows ascending, groups by their first row."""
    arrays = index.arrays
    rows = np.asarray(neurons)
    reads, writes = [], []
    for layer, neuron, _ in rows:
        prompts, positions = arrays["top_prompt"][layer, neuron, 0], arrays["top_position"][layer, neuron, 0]
        ids = [int(index.prompt_tokens(int(p))[int(q)]) for p, q in zip(prompts, positions, strict=True) if p >= 0]
        reads.append(set(index.token_text(ids)))
        writes.append({int(i) for i in arrays["write_ids"][layer, neuron, 0] if i >= 0})
    parent = list(range(len(rows)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for layer in np.unique(rows[:, 0]) if len(rows) else []:
        members = np.nonzero(rows[:, 0] == layer)[0].tolist()
        for x, a in enumerate(members):
            for b in members[x + 1:]:
                same = rows[a, 1] == rows[b, 1]
                if same or (_jaccard(reads[a], reads[b]) >= CONTEXTS and _jaccard(writes[a], writes[b]) >= WRITES):
                    parent[root(b)] = root(a)
    groups: dict[int, list[int]] = {}
    for i in range(len(rows)):
        groups.setdefault(root(i), []).append(i)
    return sorted((g for g in groups.values() if len(g) > 1), key=lambda g: g[0])


def group_adjacency(adjacency: np.ndarray, values: np.ndarray, groups: list[list[int]], n_neurons: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The graph with each group as one node: ``(adjacency', values', membership)``.

    ``adjacency`` (N, N) is ``[target, source]`` with the ``n_neurons`` neurons first; ``values`` (n_neurons,) their
    values. The new nodes are the ungrouped neurons, then one per group, then the other nodes as they were;
    ``membership`` (N', N) is 0/1 (each old node in one new node) and ``adjacency' = S A Sᵀ``: a group's links are the
    sums of its members' links; ``values'`` the neurons' and groups' values (sums)."""
    grouped = {i for g in groups for i in g}
    singles = [i for i in range(n_neurons) if i not in grouped]
    others = list(range(n_neurons, adjacency.shape[0]))
    S = np.zeros((len(singles) + len(groups) + len(others), adjacency.shape[0]))
    for row, i in enumerate(singles):
        S[row, i] = 1.0
    for row, g in enumerate(groups, start=len(singles)):
        S[row, g] = 1.0
    for row, i in enumerate(others, start=len(singles) + len(groups)):
        S[row, i] = 1.0
    k = len(singles) + len(groups)
    return S @ adjacency @ S.T, S[:k, :n_neurons] @ np.asarray(values, dtype=float), S


def group_completeness(completeness: np.ndarray, values: np.ndarray, groups: list[list[int]]) -> float:
    """The worst ``|sum of a group's incoming edges - its value| / |its value|`` over ``groups`` (rows of the
    neurons), from each neuron's ``completeness`` (relative) and ``values``: a group's links are its members' sums."""
    errors = completeness[:len(values)] * np.abs(values)  # |sum in - value| per neuron
    return max((float(errors[m].sum() / max(abs(values[m].sum()), 1e-300)) for m in groups), default=0.0)
