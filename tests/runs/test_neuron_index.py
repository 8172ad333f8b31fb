"""``detjac neurons``: the index's top-K equals a brute-force top-K, a killed run resumes to the same index, two
dask workers give the same index as one process, and bad input is refused with one line, nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from neuron_helpers import resealed
from store_helpers import write_prompts

from detjac.cli.main import main
from detjac.graph_settings import GraphSettings
from detjac.runs import ClusterOptions, NeuronOptions, build_neuron_index
from detjac.store import NeuronIndexMismatch, open_neuron_index

PROMPTS = ["The capital of France is", "Copper, n. A common metal", "Kitten, n. A young cat",
           "Paris is a city in France", "The bridge out of Marin is the"]
OPTIONS = NeuronOptions(top_k=3, shard_prompts=2)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("neurons")
    prompts = write_prompts(folder / "p.txt", PROMPTS)
    build_neuron_index("default", prompts, folder / "n.zarr", OPTIONS, progress=False)
    return prompts, folder / "n.zarr"


@pytest.fixture(scope="module")
def engine():
    from detjac.engine import load_engine

    return load_engine("default")


def test_the_top_k_and_counts_equal_a_brute_force_pass(built, engine):
    from detjac.engine.tools.neuron_values import batch_neuron_values

    _, out = built
    index = open_neuron_index(out)
    arrays = index.arrays
    ids = [engine.token_ids(text) for text in PROMPTS]
    values = {}  # layer -> list of (prompt, position, (neurons,) values), the leading BOS left out
    for s0 in range(0, len(ids), OPTIONS.shard_prompts):  # the index's shards, each one forward pass
        for p, per_layer in enumerate(batch_neuron_values(engine, ids[s0:s0 + OPTIONS.shard_prompts]), start=s0):
            assert index.prompt_tokens(p).tolist() == ids[p]
            for layer, z in per_layer.items():
                values.setdefault(layer, []).extend((p, q, z[q]) for q in range(1, z.shape[0]))
    k = OPTIONS.top_k
    for layer, rows in values.items():
        z = np.stack([r[2] for r in rows])  # (tokens, neurons)
        assert np.array_equal(arrays["n_positive"][layer], (z > 0).sum(0))
        assert np.array_equal(arrays["histogram"][layer].sum(1), np.full(z.shape[1], z.shape[0]))
        for j in range(z.shape[1]):
            for sign, pick in ((0, z[:, j] > 0), (1, z[:, j] < 0)):
                cands = sorted((-abs(z[i, j]), rows[i][0], rows[i][1], z[i, j]) for i in np.nonzero(pick)[0])[:k]
                got = list(zip(arrays["top_value"][layer, j, sign], arrays["top_prompt"][layer, j, sign],
                               arrays["top_position"][layer, j, sign], strict=True))
                assert got == [(c[3], c[1], c[2]) for c in cands] + [(0.0, -1, -1)] * (k - len(cands))
    assert index.attrs["complete"] and index.attrs["n_tokens"] == len(values[0])
    assert index.identity["k"] == 3 and index.identity["weights_sha256"]


def test_the_batched_values_are_the_walks(engine):
    from detjac.engine.tools.neuron_values import batch_neuron_values, prompt_neuron_values

    ids = [engine.token_ids(text) for text in PROMPTS[:3]]
    for p, per_layer in enumerate(batch_neuron_values(engine, ids)):
        for layer, z in prompt_neuron_values(engine, ids[p]):
            assert np.abs(per_layer[layer] - z).max() <= 1e-12 * np.abs(z).max()


def test_a_killed_run_resumes_to_the_same_index(built, tmp_path, monkeypatch):
    import detjac.runs.neurons_run as run

    prompts, whole = built
    out = tmp_path / "n.zarr"
    real, calls = run.shard_stats, []

    def dies_at_the_second_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(run, "shard_stats", dies_at_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        build_neuron_index("default", prompts, out, OPTIONS, progress=False)
    with pytest.raises(Exception, match="run the same `detjac neurons` command again"):
        open_neuron_index(out)
    monkeypatch.setattr(run, "shard_stats", real)
    outcome = build_neuron_index("default", prompts, out, OPTIONS, progress=False)
    assert outcome.resumed_shards == 1
    a, b = open_neuron_index(out).arrays, open_neuron_index(whole).arrays
    assert sorted(a) == sorted(b)
    for name in a:
        assert np.array_equal(a[name], b[name], equal_nan=a[name].dtype.kind == "f"), name


def test_an_index_made_otherwise_is_refused_by_name(built):
    prompts, out = built
    with pytest.raises(NeuronIndexMismatch, match=r"k: 3 \(index\) != 4"):
        build_neuron_index("default", prompts, out, NeuronOptions(top_k=4, shard_prompts=2), progress=False)
    with pytest.raises(NeuronIndexMismatch, match="weights_sha256"):
        open_neuron_index(out).check({"weights_sha256": "0" * 64})


@pytest.mark.parametrize("case", ["k0", "empty", "not_text"])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, case):
    good = write_prompts(tmp_path / "p.txt", PROMPTS[:1])
    corpus, extra = {"k0": (good, ["-k", "0"]), "empty": (write_prompts(tmp_path / "e.txt", [""]), []),
                     "not_text": (tmp_path / "c.jsonl", [])}[case]
    if case == "not_text":
        corpus.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": {"a": 1}}) + "\n")
    out = tmp_path / "n.zarr"
    result = CliRunner().invoke(main, ["neurons", "default", str(corpus), "--out", str(out), *extra])
    assert result.exit_code != 0 and result.exception is None or isinstance(result.exception, SystemExit)
    message = result.output.strip()
    assert len(message.splitlines()) == 1, message
    assert {"k0": "top k", "empty": "at least one prompt", "not_text": "line 2"}[case] in message
    assert not out.exists()


@pytest.mark.slow
def test_two_dask_workers_give_the_one_process_index(built, tmp_path):
    prompts, whole = built
    out = tmp_path / "n.zarr"
    from dataclasses import replace

    options = replace(OPTIONS, cluster=ClusterOptions(workers=2, memory_limit="1GiB"))
    build_neuron_index("default", prompts, out, options, progress=False)
    ia, ib = open_neuron_index(out), open_neuron_index(whole)
    a, b = ia.arrays, ib.arrays
    for name in ("histogram", "n_positive", "n_negative", "write_ids"):
        assert np.array_equal(a[name], b[name]), name
    # workers run their own thread counts: the values agree to float64 rounding, and where two contexts tie exactly
    # in one process (the same tokens up to the position: 'The' opening two prompts) rounding may order them the
    # other way, so a slot's context is the same text, not always the same prompt
    assert np.allclose(a["top_value"], b["top_value"], rtol=1e-12, atol=1e-12)
    differ = np.nonzero((a["top_prompt"] != b["top_prompt"]) | (a["top_position"] != b["top_position"]))
    for slot in zip(*differ, strict=True):
        pa, qa, pb, qb = a["top_prompt"][slot], a["top_position"][slot], b["top_prompt"][slot], b["top_position"][slot]
        assert qa == qb and ia.prompt_tokens(pa)[:qa + 1].tolist() == ib.prompt_tokens(pb)[:qb + 1].tolist()


def test_graph_labels_come_from_the_index(built, tmp_path):
    from detjac.analysis import clerp, neuron_page

    _, out = built
    path = tmp_path / "g.json"
    result = CliRunner().invoke(main, ["graph", "-p", "The capital of France is", "--out", str(path),
                                       "--max-nodes", "30", "--neurons", str(out), "--group"])
    assert result.exit_code == 0, result.output
    assert "groups " in result.output and "worst group completeness" in result.output
    index = open_neuron_index(out)
    data = json.loads(path.read_text())
    neurons = [n for n in data["nodes"] if n["feature_type"] == "mlp neuron"]
    assert neurons
    ids = {n["node_id"] for n in neurons}
    for name, *members in data["qParams"]["supernodes"]:  # circuit-tracer's supernodes: [label, node ids...]
        assert name.startswith("group ") and len(members) > 1 and set(members) <= ids
        assert len({m.split("_")[0] for m in members}) == 1  # one layer per group
    for node in neurons:
        layer, idx, _ = (int(x) for x in node["node_id"].split("_"))
        assert node["clerp"] == clerp(index, layer, idx, node["activation"])
    page = neuron_page(index, int(neurons[0]["layer"]), int(neurons[0]["node_id"].split("_")[1]))
    top = page["contexts"]["positive"][0]
    assert top["token"] == index.token_text([index.prompt_tokens(top["prompt"])[top["position"]]])[0]
    assert sum(page["histogram"]["counts"]) == index.attrs["n_tokens"]


def test_graph_refuses_an_index_of_another_model(built, tmp_path):
    _, out = built
    other = resealed(out, tmp_path / "other.zarr", {"weights_sha256": "f" * 64})
    result = CliRunner().invoke(main, ["graph", "-p", "Paris", "--out", str(tmp_path / "g.json"),
                                       "--neurons", str(other)])
    assert result.exit_code != 0
    assert "weights_sha256: 'ffff" in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "g.json").exists()


def test_grouped_graphs_keep_completeness(built, engine):
    from detjac.analysis import group_adjacency, group_neurons
    from detjac.graphs import attribution_graph

    _, out = built
    index = open_neuron_index(out)
    g = attribution_graph(engine, "The capital of France is", GraphSettings(max_nodes=120))
    groups = group_neurons(index, g.neurons)
    assert groups and all(len(set(g.neurons[m, 0])) == 1 for m in groups)  # one layer per group
    M = g.n_neurons
    A, values, S = group_adjacency(g.adjacency, g.activations, groups, M)
    k = M - sum(map(len, groups)) + len(groups)
    assert A.shape == (g.adjacency.shape[0] - M + k,) * 2 and np.array_equal(S.sum(0), np.ones(S.shape[1]))
    for row, members in enumerate(groups, start=k - len(groups)):
        # a group's incoming and outgoing links are its members' sums, its value their values' sum
        assert np.allclose(A[row], S @ g.adjacency[members].sum(0), rtol=0, atol=1e-12 * np.abs(g.adjacency).max())
        assert np.allclose(A[:, row], g.adjacency[:, members].sum(1) @ S.T, rtol=0,
                           atol=1e-12 * np.abs(g.adjacency).max())
        assert values[row] == pytest.approx(g.activations[members].sum(), rel=1e-15)
        # its incoming edges miss its value by its members' misses only: float64 rounding
        miss = abs(A[row].sum() - values[row])
        members_miss = abs(g.adjacency[members].sum(1) - g.activations[members]).sum()
        assert miss <= members_miss + 1e-12 * np.abs(g.activations[members]).sum()
    # the logits' incoming edges are the same numbers summed in another grouping
    logits = slice(A.shape[0] - g.n_logits, None)
    assert np.allclose(A[logits].sum(1), g.adjacency[-g.n_logits:].sum(1), rtol=1e-13)
