"""Exact attribution graphs of one prediction (docs/graphs.md): the layer between the engine and the runs.

The façade of the graphs layer: runs/, cli/ and users import from here, never from its modules
(tests/test_layering.py). It imports only the torch-free base (``detjac``) and the engine's façade
(:mod:`detjac.engine`). :func:`build_graph` computes a graph from a prompt's trace in phases (targets, rank, rows,
adjacency, completeness, prune, head loadings, the heads' direct effects: :func:`head_effects`); :func:`graph_step`
hands it to a prompt pass (what ``detjac graph`` and ``detjac run --graph`` both call); :func:`attribution_graph` is
the verb; :func:`graph_dict` and :func:`write_graph` give its JSON.

>>> from detjac.engine import load_engine
>>> from detjac.graphs import attribution_graph
>>> graph = attribution_graph(load_engine("default"), "The capital of France is")   # doctest: +SKIP
"""

from .build import (
    AttributionGraph,
    attribution_graph,
    build_graph,
    check_graph,
    graph_step,
    logit_attribution,
    logit_vectors,
)
from .document import graph_dict, write_graph
from .head_effects import head_effects
from .head_loadings import HeadLoadings, strongest_heads
from .prune import Pruned, prune, prune_bytes

__all__ = [
    "AttributionGraph", "HeadLoadings", "Pruned", "attribution_graph", "build_graph", "check_graph", "graph_dict",
    "graph_step", "head_effects", "logit_attribution", "logit_vectors", "prune", "prune_bytes", "strongest_heads",
    "write_graph",
]
