"""``detjac analyze graphs``: the neurons that recur across stored graphs, counted on graphs chosen by hand."""

from __future__ import annotations

import csv

import pytest
from click.testing import CliRunner

from detjac.analysis import recurring_neurons
from detjac.cli.main import main
from detjac.errors import InvalidArgumentError
from detjac.store import open_store
from detjac.store.testing import make_store, synthetic_graph

# each prompt's neurons, (layer, index, position): (1, 5) is in two graphs, at three positions in all
NEURONS = {"the oak tree": [(0, 3, 1), (1, 5, 2), (1, 5, 0)],
           "a whale and the sea": [(0, 3, 0), (2, 1, 1)],
           "the cat plays a harp": [(1, 5, 0), (0, 2, 4)]}


@pytest.fixture
def store(tmp_path):
    written = {}

    def graph(truth):
        written[truth.text] = synthetic_graph(truth, NEURONS[truth.text], n_layers=3)
        return written[truth.text]

    made = make_store(tmp_path / "g.zarr", prompts=list(NEURONS), graphs=graph)
    return open_store(made.path), written


def by_hand(graphs, layer, index, skip=()):
    """A neuron's graphs, nodes and mean attribution counted directly from graph JSON objects, its nodes at the
    positions ``skip`` (negative: from the prompt's end) left out."""
    sums, nodes = [], 0
    for graph in graphs:
        n_tokens = len(graph["metadata"]["prompt_tokens"])
        left_out = {p + n_tokens if p < 0 else p for p in skip}
        ids = [n["node_id"] for n in graph["nodes"] if n["node_id"].startswith(f"{layer}_{index}_")
               and n["feature_type"] == "mlp neuron" and n["ctx_idx"] not in left_out]
        if ids:
            nodes += len(ids)
            sums.append(sum(link["weight"] for link in graph["links"] if link["source"] in ids))
    return len(sums), nodes, sum(sums) / len(sums) if sums else None


def test_recurring_neurons_are_counted_as_by_hand(store):
    st, written = store
    result = recurring_neurons(st)
    assert result.n_graphs == 3 and result.without_graph == []
    rows = {(r["layer"], r["index"]): r for r in result.rows}
    assert set(rows) == {(0, 3), (1, 5), (2, 1), (0, 2)}
    assert [r["graphs"] for r in result.rows] == [2, 2, 1, 1]  # sorted by the graphs they appear in
    assert rows[(1, 5)]["graphs"] == 2 and rows[(1, 5)]["nodes"] == 3 and rows[(2, 1)]["graphs"] == 1
    assert rows[(1, 5)]["label"] == "writes 'n1.5'" and rows[(1, 5)]["share"] == pytest.approx(2 / 3)
    stored = [st.get(pid).graph() for pid in st.prompt_ids()]  # what the store holds, counted independently
    for (layer, index), row in rows.items():
        graphs, nodes, mean = by_hand(stored, layer, index)
        assert (row["graphs"], row["nodes"]) == (graphs, nodes)
        assert row["mean_attribution"] == pytest.approx(mean, rel=1e-12)
    assert sorted(rows[(0, 3)]["prompt_ids"]) == sorted(
        pid for pid in st.prompt_ids() if st.get(pid).prompt in ("the oak tree", "a whale and the sea"))
    assert [r["graphs"] for r in recurring_neurons(st, min_graphs=2).rows] == [2, 2]


def test_the_table_and_the_command(store, tmp_path):
    st, _ = store
    table = tmp_path / "neurons.csv"
    result = CliRunner().invoke(main, ["analyze", "graphs", str(st.path), "--table", str(table), "--top", "1"])
    assert result.exit_code == 0, result.output
    assert "4 neurons in 3 graphs" in result.output and "... 3 more" in result.output
    rows = list(csv.DictReader(table.open()))
    assert [int(r["graphs"]) for r in rows] == [2, 2, 1, 1]
    assert {(r["layer"], r["index"]) for r in rows[:2]} == {("0", "3"), ("1", "5")}
    parquet = tmp_path / "neurons.parquet"
    recurring_neurons(st, table=parquet)
    import pyarrow.parquet as pq

    assert pq.read_table(parquet).num_rows == 4


def test_a_store_without_graphs_is_refused(tmp_path):
    made = make_store(tmp_path / "s.zarr", prompts=2)
    with pytest.raises(InvalidArgumentError, match="detjac run --graph"):
        recurring_neurons(open_store(made.path))
    result = CliRunner().invoke(main, ["analyze", "graphs", str(made.path)])
    assert result.exit_code == 1 and "detjac run --graph" in result.output


@pytest.mark.parametrize("name", ["neurons.csv", "neurons.parquet"])
def test_a_full_disk_leaves_no_table_and_says_so_in_one_line(store, tmp_path, monkeypatch, name):
    import errno

    import pyarrow.parquet as pq

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    st, _ = store
    monkeypatch.setattr(csv.DictWriter, "writerows", full)  # the disk fills while the rows are written
    monkeypatch.setattr(pq, "write_table", full)
    result = CliRunner().invoke(main, ["analyze", "graphs", str(st.path), "--table", str(tmp_path / name)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert f"Expected to write the table {tmp_path / name}. Got the disk is full; nothing was written there." in \
        result.output.replace("\n", " ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr"]


@pytest.mark.parametrize("skip", [(0,), (0, -1), (7, -9)])  # positions past a prompt's ends skip nothing there
def test_skipped_positions_leave_their_neurons_out(store, skip):
    st, _ = store
    result = recurring_neurons(st, skip_positions=skip)
    assert result.skipped_positions == skip
    stored = [st.get(pid).graph() for pid in st.prompt_ids()]
    rows = {(r["layer"], r["index"]): r for r in result.rows}
    expected = {key: by_hand(stored, *key, skip=skip) for key in {(0, 3), (1, 5), (2, 1), (0, 2)}}
    assert set(rows) == {key for key, (graphs, _, _) in expected.items() if graphs}
    if 0 in skip:
        assert rows.get((1, 5), {"graphs": 0})["graphs"] < 2  # it sat at position 0 in two graphs
    for key, row in rows.items():
        graphs, nodes, mean = expected[key]
        assert (row["graphs"], row["nodes"]) == (graphs, nodes)
        assert row["mean_attribution"] == pytest.approx(mean, rel=1e-12)


def test_the_command_skips_positions_and_refuses_a_bad_list(store):
    st, _ = store
    result = CliRunner().invoke(main, ["analyze", "graphs", str(st.path), "--skip-positions", "0"])
    assert result.exit_code == 0, result.output
    assert "neurons at position 0 left out" in result.output
    assert "4 neurons in 3 graphs" in result.output  # every neuron still has a node elsewhere
    lines = [line.split() for line in result.output.splitlines() if line[:5].strip().isdigit()]
    assert [(int(f[0]), int(f[1]), int(f[2])) for f in lines if (int(f[0]), int(f[1])) == (1, 5)] == [(1, 5, 1)]
    bad = CliRunner().invoke(main, ["analyze", "graphs", str(st.path), "--skip-positions", "first"])
    assert bad.exit_code == 2 and "Expected comma-separated token positions" in bad.output
    with pytest.raises(InvalidArgumentError, match="integer positions"):
        recurring_neurons(st, skip_positions=["0"])
