"""A prompt's attribution graph in the store (``detjac run --graph``): node and link tables that read back as the exact
JSON object written, sealed and checksummed like the prompt's other arrays. No torch: synthetic graphs."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
from click.testing import CliRunner
from store_helpers import reseal

from detjac.cli.main import main
from detjac.errors import StoreError
from detjac.store import open_store
from detjac.store.graph_tables import graph_json, graph_tables
from detjac.store.integrity import CorruptError
from detjac.store.testing import make_store, synthetic_graph

NEURONS = [(0, 3, 1), (1, 5, 2), (1, 5, 3), (0, 7, 0)]


@pytest.fixture
def graph_store(tmp_path):
    written = {}

    def graph(truth):
        written[truth.id] = synthetic_graph(truth, NEURONS)
        return copy.deepcopy(written[truth.id])

    store = make_store(tmp_path / "g.zarr", prompts=2, graphs=graph)
    return store, written


def test_a_stored_graph_reads_back_as_the_json_written(graph_store):
    store, written = graph_store
    opened = open_store(store.path)
    assert sorted(written) == sorted(opened.prompt_ids())
    for pid, data in written.items():
        assert opened.get(pid).graph() == data
    group = store.path / "prompts" / pid / "graph"
    arrays = {p.name for p in group.iterdir() if p.is_dir()}
    assert {"node_kind", "node_layer", "node_index", "node_label", "link_source", "link_target",
            "link_weight"} <= arrays
    meta = json.loads((group / "link_weight" / "zarr.json").read_text())
    assert meta["codecs"][-1]["name"] == "crc32c" and meta["dimension_names"] == ["link"]
    label_meta = json.loads((group / "node_label" / "zarr.json").read_text())
    assert label_meta["codecs"][-1]["name"] == "crc32c"  # the labels are checksummed too


def test_a_prompt_without_a_graph_has_none(tmp_path):
    store = make_store(tmp_path / "s.zarr", prompts=1)
    prompt = next(iter(open_store(store.path)))
    assert prompt.graph() is None and prompt.graph_arrays() is None


def test_the_stored_tables_are_the_jsons_nodes_and_links(graph_store):
    store, written = graph_store
    for pid, data in written.items():
        tables = open_store(store.path).get(pid).graph_arrays()
        assert len(tables["node_kind"]) == len(data["nodes"]) and len(tables["link_weight"]) == len(data["links"])
        ids = [node["node_id"] for node in data["nodes"]]
        assert [ids[s] for s in tables["link_source"].tolist()] == [link["source"] for link in data["links"]]
        assert tables["link_weight"].tolist() == [link["weight"] for link in data["links"]]


def test_the_tables_hold_the_json_exactly_or_refuse_it(graph_store):
    store, written = graph_store
    data = next(iter(written.values()))
    arrays, attrs = graph_tables(data)
    assert arrays["node_kind"].tolist()[:len(NEURONS)] == [0] * len(NEURONS)
    assert arrays["node_layer"].tolist()[:len(NEURONS)] == [n[0] for n in NEURONS]
    assert graph_json(arrays, attrs) == data
    odd = copy.deepcopy(data)
    odd["nodes"][0]["extra"] = 1  # a key the tables do not hold: refused, not dropped
    with pytest.raises(StoreError, match="tables hold exactly"):
        graph_tables(odd)
    dangling = copy.deepcopy(data)
    dangling["links"][0]["source"] = "9_9_9"
    with pytest.raises(StoreError, match="circuit-tracer's JSON"):
        graph_tables(dangling)


def test_commit_refuses_a_prompt_begun_with_a_graph_without_one(tmp_path):
    store = make_store(tmp_path / "s.zarr", prompts=1)
    from detjac.store import create_store

    with create_store(store.path, store.run) as writable:  # resumed
        pid = "0123456789abcdef"
        writer = writable.begin(pid, n_rows=8, n_tokens=2, n_cols=8, dtype="float64", row_block=8, graph=True)
        writer.write_rows(0, 8, np.zeros((8, 2, 8)))
        for name, shape in (("embeddings", (2, 8)), ("output", (8,))):
            writer.write_array(name, np.zeros(shape))
        writer.write_array("token_ids", np.zeros(2, dtype=np.int64))
        with pytest.raises(StoreError, match="graph"):
            writer.commit({"prompt": "x"})
    assert pid not in open_store(store.path).prompt_ids()


def _flip(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("array", ["link_weight", "node_activation", "node_label"])
def test_verify_and_readers_refuse_a_damaged_graph_array(graph_store, array):
    store, written = graph_store
    pid = sorted(written)[0]
    folder = store.path / "prompts" / pid
    _flip(folder / "graph" / array / "c" / "0")
    verify = CliRunner().invoke(main, ["store", "verify", str(store.path)])
    assert verify.exit_code == 1 and f"CORRUPT {pid}: file graph/{array}/c/0 changed since commit" in verify.output
    reseal(folder)  # behind the seal: the chunk's crc32c still refuses it, never a number
    for read in ("graph", "graph_arrays"):  # the JSON object and the tables alike
        with pytest.raises(CorruptError, match="crc32c"):
            getattr(open_store(store.path).get(pid), read)()
    verify = CliRunner().invoke(main, ["store", "verify", str(store.path)])
    assert verify.exit_code == 1 and f"CORRUPT {pid}" in verify.output and "crc32c" in verify.output
    other = sorted(written)[1]
    assert open_store(store.path).get(other).graph() == written[other]  # the other prompt is intact


def test_a_removed_graph_array_is_damage(graph_store):
    store, written = graph_store
    pid = sorted(written)[0]
    folder = store.path / "prompts" / pid
    (folder / "graph" / "link_target" / "c" / "0").unlink()
    verify = CliRunner().invoke(main, ["store", "verify", str(store.path)])
    assert verify.exit_code == 1 and f"CORRUPT {pid}: missing file graph/link_target/c/0" in verify.output


def _swap(a, b):
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)


def test_equal_sized_chunks_swapped_within_a_prompt_never_read_back(graph_store):
    store, written = graph_store
    pid = sorted(written)[0]
    graph = store.path / "prompts" / pid / "graph"
    chunks = [graph / name / "c" / "0" for name in ("node_index", "node_feature")]
    assert chunks[0].stat().st_size == chunks[1].stat().st_size  # what a size check cannot see
    _swap(*chunks)
    for read in ("graph", "graph_arrays"):
        with pytest.raises(CorruptError, match=f"Expected an intact graph of prompt {pid} .* file "
                                               "graph/node_feature/c/0 changed since commit"):
            getattr(open_store(store.path).get(pid), read)()
    exported = CliRunner().invoke(main, ["analyze", "graphs", str(store.path)])
    assert exported.exit_code == 1 and "changed since commit" in exported.output and "Traceback" not in exported.output
    reseal(graph.parent)  # behind a seal made anew: the columns contradict each other
    with pytest.raises(CorruptError, match="Expected node columns that agree with each other. Got 4 neurons with .* "
                                           "a feature that is not the code of its"):
        open_store(store.path).get(pid).graph()


def test_a_chunk_swapped_between_prompts_never_reads_back(tmp_path):
    graphs = iter([NEURONS, [(0, 2, 1), (1, 4, 2), (1, 6, 3), (0, 1, 0)]])  # other neurons, as many
    made = make_store(tmp_path / "g.zarr", prompts=2, graphs=lambda truth: synthetic_graph(truth, next(graphs)))
    chunks = [made.path / "prompts" / pid / "graph" / "node_feature" / "c" / "0" for pid in sorted(made.prompts)]
    assert chunks[0].read_bytes() != chunks[1].read_bytes() and chunks[0].stat().st_size == chunks[1].stat().st_size
    _swap(*chunks)
    for pid in sorted(made.prompts):
        with pytest.raises(CorruptError, match="file graph/node_feature/c/0 changed since commit"):
            open_store(made.path).get(pid).graph()


def test_a_chunk_of_another_node_count_is_one_line(tmp_path):
    from store_helpers import reseal as reseal_group

    graphs = iter([NEURONS, NEURONS[:2]])
    made = make_store(tmp_path / "g.zarr", prompts=2, graphs=lambda truth: synthetic_graph(truth, next(graphs)))
    big, small = sorted(made.prompts)
    folder = made.path / "prompts" / big
    (folder / "graph" / "node_kind" / "c" / "0").write_bytes(
        (made.path / "prompts" / small / "graph" / "node_kind" / "c" / "0").read_bytes())
    with pytest.raises(CorruptError, match="changed since commit|has \\d+ bytes"):
        open_store(made.path).get(big).graph()
    reseal_group(folder)  # resealed: the chunk decodes to fewer values than its array's shape
    with pytest.raises(CorruptError, match="a chunk that does not decode to its array's shape"):
        open_store(made.path).get(big).graph()


def _loaded_graph():
    """A synthetic graph (two layers) whose links carry head loadings (two heads) on exactly the layers each crosses:
    a token into a layer-0 neuron crosses layer 0, into a layer-1 neuron layers 0 and 1; a layer-0 neuron into the
    logit layer 1; a layer-1 neuron into the logit none. Its arrays, and the loaded row of each such link."""
    from types import SimpleNamespace

    truth = SimpleNamespace(id="p", text="a b c d", n_tokens=4, token_ids=[1, 2, 3, 4], next_token_id=5)
    data = synthetic_graph(truth, [(0, 3, 1), (1, 5, 2)])
    crossing = {("E_1_0", "0_3_1"): [0], ("E_1_0", "1_5_2"): [0, 1], ("0_3_1", "3_5_3"): [1], ("1_5_2", "3_5_3"): []}
    for link in data["links"]:
        layers = crossing.get((link["source"], link["target"]))
        if layers is not None:
            w = link["weight"]
            link["head_loadings"] = {str(layer): {"0": w / 4, "1": w / 2, "skip": w / 4} for layer in layers}
    arrays, attrs = graph_tables(data)
    ids = [n["node_id"] for n in data["nodes"]]
    row = {(ids[arrays["link_source"][k]], ids[arrays["link_target"][k]]): i
           for i, k in enumerate(arrays["loaded_link"].tolist())}
    return data, arrays, attrs, row


def test_stored_loadings_read_back_on_the_layers_each_link_crosses():
    data, arrays, attrs, _ = _loaded_graph()
    assert graph_json(arrays, attrs) == data
    assert [len(link["head_loadings"]) for link in data["links"] if "head_loadings" in link] == [1, 2, 1, 0]


@pytest.mark.parametrize(("link", "layer", "heads", "got"), [
    (("E_1_0", "1_5_2"), 1, slice(None), "no loadings (NaN) at layer 1 of link"),  # would read as crossing 0 only
    (("E_1_0", "0_3_1"), 0, slice(None), "no loadings (NaN) at layer 0 of link"),  # would read as crossing none
    (("E_1_0", "1_5_2"), 0, 1, "a NaN among the loadings of layer 0"),
    (("0_3_1", "3_5_3"), 0, "numbers", "loadings at layer 0 of link"),  # a layer it does not cross
])
def test_damaged_stored_loadings_raise_instead_of_reading_as_another_split(link, layer, heads, got):
    _, arrays, attrs, row = _loaded_graph()
    values = arrays["loaded_heads"].copy()
    if heads == "numbers":
        values[row[link], layer] = 1.0
    else:
        values[row[link], layer, heads] = np.nan
    with pytest.raises(StoreError, match=r"exactly the layers each loaded link crosses\. Got " + re.escape(got)):
        graph_json({**arrays, "loaded_heads": values}, attrs)


# -- QK records and the graph group's version ------------------------------------------------------------------------


def _with_qk(data):
    """``data`` with a QK record on a head node (QK-only, as ``--qk`` adds it) naming a kept token, a kept neuron
    and a QK-only MLP node; each side's marginals sum to the head's score."""
    from detjac.graph_nodes import HEAD, MLP
    from detjac.graph_schema import node_columns, nodes_json

    out = copy.deepcopy(data)
    columns = {name: values.tolist() for name, values in node_columns(out["nodes"]).items()}
    columns["node_qk_only"] = [0] * len(out["nodes"])
    pos = out["nodes"][-1]["ctx_idx"]
    for kind, layer, index, act in ((HEAD, 1, 2, 0.75), (MLP, 0, -1, float("nan"))):
        for name, value in zip(columns, (kind.code, layer, index, pos, kind.feature_of(layer, index, pos), act, 1.0,
                                         float("nan"), f"{kind.name} {layer}", 1), strict=True):
            columns[name].append(value)
    head, mlp, token, neuron = len(columns["node_kind"]) - 2, len(columns["node_kind"]) - 1, len(NEURONS), 0
    nodes = nodes_json(columns)
    ids = [node["node_id"] for node in nodes]
    nodes[head]["qk_tracing_results"] = {
        "pair_wise_contributors": [[ids[mlp], ids[token], 0.5], [ids[neuron], ids[token], 0.25]],
        "top_q_marginal_contributors": [[ids[mlp], 0.5], [ids[neuron], 0.25]],
        "top_k_marginal_contributors": [[ids[token], 0.75]]}
    out["nodes"] = nodes
    return out


def test_qk_records_and_qk_only_nodes_read_back_as_written(tmp_path):
    written = {}

    def graph(truth):
        written[truth.id] = _with_qk(synthetic_graph(truth, NEURONS))
        return copy.deepcopy(written[truth.id])

    store = make_store(tmp_path / "qk.zarr", prompts=1, graphs=graph)
    (pid, data), = written.items()
    prompt = open_store(store.path).get(pid)
    assert prompt.graph() == data
    tables = prompt.graph_arrays()
    assert tables["node_qk_only"].tolist() == [0] * (len(data["nodes"]) - 2) + [1, 1]
    assert tables["qk_pair_value"].tolist() == [0.5, 0.25] and tables["qk_k_node"].tolist() == [len(NEURONS)]
    attrs = json.loads((store.path / "prompts" / pid / "graph" / "zarr.json").read_text())["attributes"]
    assert attrs["graph_version"] == 2 and "attention head" in attrs["kinds"]


def test_a_graph_stored_before_qk_records_still_opens_and_a_later_version_is_refused(graph_store):
    """A version-1 graph group (before QK records: no ``graph_version``, four kinds) reads back as written."""
    store, written = graph_store
    pid = sorted(written)[0]
    group = store.path / "prompts" / pid / "graph"
    meta = json.loads((group / "zarr.json").read_text())
    meta["attributes"].pop("graph_version")
    meta["attributes"]["kinds"] = ["mlp neuron", "embedding", "logit", "bias"]
    (group / "zarr.json").write_text(json.dumps(meta))
    reseal(group.parent)
    assert open_store(store.path).get(pid).graph() == written[pid]
    meta["attributes"]["graph_version"] = 3
    (group / "zarr.json").write_text(json.dumps(meta))
    reseal(group.parent)
    with pytest.raises(StoreError, match="Expected a graph group of version 1 to 2. Got 3"):
        open_store(store.path).get(pid).graph()


def test_damaged_qk_records_raise_instead_of_reading_back(graph_store):
    arrays, attrs = graph_tables(_with_qk(next(iter(graph_store[1].values()))))
    for name, value, message in (("qk_pair_key", [0, 99], "naming the graph's .* nodes. Got node 99"),
                                 ("qk_q_record", [0, 5], "records. Got record 5"),
                                 ("node_qk_only", None, "node_qk_only of .* values 0 or 1")):
        damaged = {**arrays, name: np.asarray(value, dtype=np.int64) if value is not None
                   else np.full_like(arrays[name], 2)}
        with pytest.raises(StoreError, match=message):
            graph_json(damaged, attrs)
    partial = {k: v for k, v in arrays.items() if k != "qk_k_value"}
    with pytest.raises(StoreError, match="every QK array"):
        graph_json(partial, attrs)
