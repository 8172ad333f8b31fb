"""``detjac analyze graphs``: the neurons that recur across stored graphs, counted on graphs chosen by hand."""

from __future__ import annotations

import csv

import pytest
from click.testing import CliRunner
from store_factory import make_store, synthetic_graph

from detjac.analysis import recurring_neurons
from detjac.cli.main import main
from detjac.errors import InvalidArgumentError
from detjac.store import open_store

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


def by_hand(graphs, layer, index):
    """A neuron's graphs, nodes and mean attribution counted directly from graph JSON objects."""
    sums, nodes = [], 0
    for graph in graphs:
        ids = [n["node_id"] for n in graph["nodes"] if n["node_id"].startswith(f"{layer}_{index}_")
               and n["feature_type"] == "mlp neuron"]
        if ids:
            nodes += len(ids)
            sums.append(sum(link["weight"] for link in graph["links"] if link["source"] in ids))
    return len(sums), nodes, sum(sums) / len(sums)


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
