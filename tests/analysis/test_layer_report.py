"""The layer report (``detjac analyze layers``) at the library level: rows, emergence, files, errors."""

from __future__ import annotations

import csv

import pytest
from planted import P0, P1, planted_store

from detjac.analysis import layers
from detjac.analysis.layer_report import layerwise_report
from detjac.errors import InvalidArgumentError


@pytest.fixture
def store(tmp_path):
    return planted_store(tmp_path / "s.zarr", left=31, layer_from=2, prompts=("first", "second"))


def test_the_report_finds_the_planted_layer_and_writes_every_file(store, tmp_path):
    out = tmp_path / "L"
    report = layerwise_report(store, [P0, P1], out, k=2, top=1, token="id:31", heatmaps=1)
    assert report.rows == layers.layer_table(store, [P0, P1], k=2, top=1, token=31)  # reused from the store
    assert report.emerged == layers.emergence(report.rows)
    by = {(e["prompt_id"], e["component"]): e for e in report.emerged}
    assert by[P0, "layer"]["first_layer_u1"] == 2 and by[P1, "layer"]["first_layer_u1"] == 2
    assert [p.name for p in report.written] == ["layers.csv", "emergence.csv", "layer_dims.png", "emergence.png",
                                                f"heatmap_{P0}.png"]  # heatmaps for the first prompt only
    assert all(p.parent == out for p in report.written) and report.out == out and report.top == 1
    with open(out / "layers.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == len(report.rows) == 2 * 5 and {r["token"] for r in table} == {"31"}
    assert {r["target"] for r in table} == {"layer.0", "layer.1", "layer.2", "layer.3", "mlp_local.1"}
    assert len((out / "emergence.csv").read_text().splitlines()) == 1 + len(report.emerged)
    for name in ("layer_dims.png", "emergence.png", f"heatmap_{P0}.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name
    assert report.token_text(31) == "31"  # no tokenizer in the store: ids as text


def test_parquet_tables_and_the_prediction_tracked_by_default(store, tmp_path):
    import pyarrow.parquet as pq

    report = layerwise_report(store, [P0], tmp_path / "L", k=2, top=1, heatmaps=0, table_format="parquet")
    assert [p.name for p in report.written] == ["layers.parquet", "emergence.parquet", "layer_dims.png",
                                                "emergence.png"]
    rows = pq.read_table(tmp_path / "L" / "layers.parquet").to_pylist()
    assert {r["token"] for r in rows} == {31}  # the stored next token id
    assert [r["target"] for r in rows] == [r["target"] for r in report.rows]


def test_errors_name_what_was_expected(store, tmp_path):
    with pytest.raises(InvalidArgumentError, match="Expected table_format 'csv' or 'parquet'. Got 'xlsx'"):
        layerwise_report(store, [P0], tmp_path / "L", table_format="xlsx")
    with pytest.raises(InvalidArgumentError, match=r"Expected id:N with 0 <= N < 50. Got 'id:99'"):
        layerwise_report(store, [P0], tmp_path / "L", token="id:99")
    with pytest.raises(InvalidArgumentError, match="Expected a tokenizer in the store"):
        layerwise_report(store, [P0], tmp_path / "L", token=" tree")
    with pytest.raises(InvalidArgumentError, match="Expected stored attn.L targets"):
        layerwise_report(store, [P0], tmp_path / "L", component="attn")
    assert not (tmp_path / "L").exists()  # nothing written before the errors
