"""detjac's graph JSON is one Neuronpedia accepts (its draft-07 graph schema: tests/graphs/neuronpedia_schema.py),
with QK records (``--qk``) in Neuronpedia's form that name the graph's nodes, sum exactly to the score they explain,
and survive the store; on the shipped default model and (slow) on SmolLM2."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from neuronpedia_schema import SCHEMA

from detjac.engine import load_engine, qk_attribution
from detjac.graph_settings import GraphSettings
from detjac.graphs import attribution_graph, graph_dict
from detjac.store.graph_tables import graph_json, graph_tables

PROMPT = "Copper, n. A"


def _checked(engine, heads, max_nodes):
    graph = attribution_graph(engine, PROMPT, GraphSettings(max_nodes=max_nodes, qk=heads))
    data = json.loads(json.dumps(graph_dict(graph, slug="copper", model="m"), allow_nan=False))  # standard JSON
    errors = sorted(jsonschema.Draft7Validator(SCHEMA).iter_errors(data), key=str)
    assert not errors, f"Expected a graph Neuronpedia's schema accepts. Got: {errors[0].message} at " \
                       f"{list(errors[0].absolute_path)}"
    assert set(data["metadata"]["info"]["generator"]) == {"name", "version", "url"}
    ids = {node["node_id"]: node for node in data["nodes"]}
    assert len(ids) == len(data["nodes"])
    traced = [node for node in data["nodes"] if "qk_tracing_results" in node]
    assert [(n["layer"], n["feature_type"]) for n in traced] == [(str(layer), "attention head") for layer, _ in heads]
    for node, (layer, head) in zip(traced, heads, strict=True):
        results = node["qk_tracing_results"]
        named = [i for q, k, _ in results["pair_wise_contributors"] for i in (q, k)]
        named += [i for side in ("top_q_marginal_contributors", "top_k_marginal_contributors")
                  for i, _ in results[side]]
        assert set(named) <= set(ids)  # every component is a node of the graph (QK-only where the graph has none)
        real = qk_attribution(engine, graph.token_ids, layer, head, query=graph.position)
        key = max(real.keys, key=lambda k: k["probability"])
        assert node["activation"] == key["score"] and node["is_from_qk_tracing"] is True
        for side in ("top_q_marginal_contributors", "top_k_marginal_contributors"):
            total = math.fsum(v for _, v in results[side])
            assert abs(total - key["score"]) <= 1e-12 * max(1.0, abs(key["score"]))
    assert graph_json(*graph_tables(data)) == data  # the store keeps the QK records as written
    return data


def test_the_default_models_graph_with_qk_records_is_one_neuronpedia_accepts():
    data = _checked(load_engine("default"), ((1, 0), (3, 2)), max_nodes=30)
    qk_only = [n for n in data["nodes"] if n.get("is_from_qk_tracing")]
    assert {n["feature_type"] for n in qk_only} >= {"attention head", "mlp"}
    assert not any(link["source"] in {n["node_id"] for n in qk_only} for link in data["links"])  # no edge: QK only


def test_bad_qk_heads_are_refused_before_any_work():
    from detjac.errors import InvalidArgumentError
    from detjac.graph_settings import parse_qk_head

    assert parse_qk_head("3.1") == (3, 1) == parse_qk_head("L3.H1")
    with pytest.raises(InvalidArgumentError, match="Expected a head as LAYER.HEAD .* Got '3'"):
        parse_qk_head("3")
    engine = load_engine("default")
    with pytest.raises(InvalidArgumentError, match="Expected each --qk head among layers 0 to 3 .* Got 9.0"):
        attribution_graph(engine, PROMPT, GraphSettings(max_nodes=5, qk=((9, 0),)))
    with pytest.raises(InvalidArgumentError, match="Expected the in-memory engine for --qk"):
        attribution_graph(load_engine("default", streamed=True), PROMPT, GraphSettings(max_nodes=5, qk=((0, 0),)))


@pytest.mark.slow
def test_smollm2s_graph_with_qk_records_is_one_neuronpedia_accepts():
    from real_models import smollm2_path

    _checked(load_engine(str(smollm2_path())), ((10, 4),), max_nodes=200)
