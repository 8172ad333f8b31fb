"""Neuronpedia's graph schema (draft-07), written here from its documentation (the web app's graph API,
``apps/webapp/app/api/graph/graph-schema.json`` of hijohnnylin/neuronpedia): the required fields and the types it
declares, so that a graph detjac writes is one Neuronpedia accepts for upload. The ``qk_tracing_results`` of a node
are checked as Neuronpedia's frontend reads them (pairs ``[query id, key id, attribution]``, each side's marginals
``[id, attribution]``)."""

from __future__ import annotations

from typing import Any

STRING = {"type": "string"}
NUMBER = {"type": "number"}
PAIR = {"type": "array", "minItems": 3, "maxItems": 3, "items": [STRING, STRING, NUMBER]}
MARGINAL = {"type": "array", "minItems": 2, "maxItems": 2, "items": [STRING, NUMBER]}

SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "required": ["metadata", "qParams", "nodes", "links"],
    "properties": {
        "metadata": {
            "type": "object",
            "required": ["slug", "scan", "prompt_tokens", "prompt"],
            "properties": {
                "slug": STRING, "scan": STRING, "prompt": STRING,
                "prompt_tokens": {"type": "array", "items": STRING},
                "node_threshold": NUMBER,
                "info": {"type": "object", "properties": {
                    "description": STRING, "creator_name": STRING, "creator_url": STRING,
                    "source_urls": {"type": "array"}, "create_time_ms": NUMBER,
                    "generator": {"type": "object", "properties": {
                        "name": STRING, "version": STRING, "url": STRING, "email": STRING}}}},
                "generation_settings": {"type": "object"},
                "pruning_settings": {"type": "object"},
            },
        },
        "qParams": {"type": "object", "required": [], "properties": {
            "pinnedIds": {"type": "array", "items": STRING}, "supernodes": {"type": "array"},
            "linkType": STRING, "clickedId": STRING, "sg_pos": STRING}},
        "nodes": {"type": "array", "items": {
            "type": "object",
            "required": ["node_id", "feature", "layer", "ctx_idx", "feature_type", "jsNodeId", "clerp"],
            "properties": {
                "node_id": STRING, "feature": {"type": ["integer", "null"]}, "layer": {"type": ["string", "integer"]},
                "ctx_idx": {"type": "integer"}, "feature_type": STRING, "jsNodeId": STRING, "clerp": STRING,
                "influence": {"type": ["number", "null"]}, "activation": {"type": ["number", "null"]},
                "qk_tracing_results": {"type": "object", "required": [
                    "pair_wise_contributors", "top_q_marginal_contributors", "top_k_marginal_contributors"],
                    "properties": {"pair_wise_contributors": {"type": "array", "items": PAIR},
                                   "top_q_marginal_contributors": {"type": "array", "items": MARGINAL},
                                   "top_k_marginal_contributors": {"type": "array", "items": MARGINAL}}},
            }}},
        "links": {"type": "array", "items": {
            "type": "object", "required": ["source", "target", "weight"],
            "properties": {"source": STRING, "target": STRING, "weight": NUMBER}}},
    },
}
