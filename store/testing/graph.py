"""A synthetic attribution graph for a synthetic prompt (see :mod:`detjac.store.testing`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ... import __version__
from ...graph_nodes import LOGIT, NEURON, TOKEN, TOKEN_LAYER
from ...graph_schema import NODE_COLUMNS, generator, nodes_json
from .model import WORDS, PromptTruth


def synthetic_graph(truth: PromptTruth, neurons: Sequence[tuple[int, int, int]], *, n_layers: int = 2,
                    seed: int = 0) -> dict[str, Any]:
    """A graph JSON object of the shape ``detjac.graphs.graph_dict`` makes (circuit-tracer's schema_version 1) for
    ``truth``'s tokens: the ``neurons`` given as (layer, index, position), every token, and two logits; links from
    every token to every neuron and from every neuron to the first logit, with random weights."""
    rng = np.random.default_rng([seed, len(neurons)])
    n, logit_layer, pos = truth.n_tokens, n_layers + 1, truth.n_tokens - 1
    keys = [(NEURON, layer, index, p) for layer, index, p in neurons]
    keys += [(TOKEN, TOKEN_LAYER, token, p) for p, token in enumerate(truth.token_ids)]
    keys += [(LOGIT, logit_layer, token, pos) for token in (truth.next_token_id, (truth.next_token_id + 1) % 40)]
    columns: dict[str, list[Any]] = {name: [] for name in NODE_COLUMNS}
    for kind, layer, index, p in keys:
        k = len(columns["node_kind"]) - len(neurons) - n  # the logits' rank
        prob = 0.6 - 0.3 * k if kind is LOGIT else float("nan")
        label = (f"writes 'n{layer}.{index}'" if kind is NEURON else f'Output "w{index}" (p={prob:.3f})'
                 if kind is LOGIT else WORDS[index] if index < len(WORDS) else str(index))
        influence = float(rng.uniform())  # drawn in the order the tests' stores have always been drawn in
        act = float(rng.standard_normal()) if kind is not TOKEN else float("nan")
        for name, value in zip(NODE_COLUMNS, (kind.code, layer, index, p, kind.feature_of(layer, index, p), act,
                                              influence, prob, label), strict=True):
            columns[name].append(value)
    nodes = nodes_json(columns)
    neuron_ids = [node["node_id"] for node in nodes[:len(neurons)]]
    token_ids = [node["node_id"] for node in nodes[len(neurons):len(neurons) + n]]
    target = nodes[len(neurons) + n]["node_id"]
    links = [{"source": t, "target": m, "weight": float(rng.standard_normal())} for m in neuron_ids for t in token_ids]
    links += [{"source": m, "target": target, "weight": float(rng.standard_normal())} for m in neuron_ids]
    metadata = {"slug": truth.id, "scan": "synthetic", "transcoder_list": [], "prompt_tokens": [str(t) for t in
                truth.token_ids], "prompt": truth.text, "node_threshold": 0.8, "schema_version": 1,
                "info": {"generator": generator(__version__), "exact": True, "error_nodes": 0, "edge_threshold": 0.98}}
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": qparams, "nodes": nodes, "links": links}
