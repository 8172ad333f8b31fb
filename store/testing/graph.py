"""A synthetic attribution graph for a synthetic prompt (see :mod:`detjac.store.testing`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .model import WORDS, PromptTruth


def synthetic_graph(truth: PromptTruth, neurons: Sequence[tuple[int, int, int]], *, n_layers: int = 2,
                    seed: int = 0) -> dict[str, Any]:
    """A graph JSON object of the shape ``detjac.graphs.graph_dict`` makes (circuit-tracer's schema_version 1) for
    ``truth``'s tokens: the ``neurons`` given as (layer, index, position), every token, and two logits; links from
    every token to every neuron and from every neuron to the first logit, with random weights."""
    rng = np.random.default_rng([seed, len(neurons)])
    n, logit_layer, pos = truth.n_tokens, n_layers + 1, truth.n_tokens - 1
    nodes: list[dict[str, Any]] = []
    for layer, index, p in neurons:
        nodes.append({"node_id": f"{layer}_{index}_{p}", "feature": (layer + index) * (layer + index + 1) // 2 + index,
                      "layer": str(layer), "ctx_idx": p, "feature_type": "mlp neuron", "jsNodeId": f"{layer}_{index}-0",
                      "clerp": f"writes 'n{layer}.{index}'", "influence": float(rng.uniform()),
                      "activation": float(rng.standard_normal())})
    for p, token in enumerate(truth.token_ids):
        nodes.append({"node_id": f"E_{token}_{p}", "feature": p, "layer": "E", "ctx_idx": p,
                      "feature_type": "embedding", "jsNodeId": f"E_{token}-{p}", "clerp": WORDS[token]
                      if token < len(WORDS) else str(token), "influence": float(rng.uniform())})
    for k, token in enumerate((truth.next_token_id, (truth.next_token_id + 1) % 40)):
        nodes.append({"node_id": f"{logit_layer}_{token}_{pos}", "feature": token, "layer": str(logit_layer),
                      "ctx_idx": pos, "feature_type": "logit", "token_prob": 0.6 - 0.3 * k, "is_target_logit": k == 0,
                      "jsNodeId": f"L_{token}-{pos}", "clerp": f'Output "w{token}" (p={0.6 - 0.3 * k:.3f})',
                      "influence": float(rng.uniform()), "activation": float(rng.standard_normal())})
    neuron_ids = [node["node_id"] for node in nodes[:len(neurons)]]
    token_ids = [node["node_id"] for node in nodes[len(neurons):len(neurons) + n]]
    target = nodes[len(neurons) + n]["node_id"]
    links = [{"source": t, "target": m, "weight": float(rng.standard_normal())} for m in neuron_ids for t in token_ids]
    links += [{"source": m, "target": target, "weight": float(rng.standard_normal())} for m in neuron_ids]
    metadata = {"slug": truth.id, "scan": "synthetic", "transcoder_list": [], "prompt_tokens": [str(t) for t in
                truth.token_ids], "prompt": truth.text, "node_threshold": 0.8, "schema_version": 1,
                "info": {"generator": "detjac", "exact": True, "error_nodes": 0, "edge_threshold": 0.98}}
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": qparams, "nodes": nodes, "links": links}
