"""The reports behind `detjac analyze svd|decode|dims|compare` at the library level, on planted stores."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from planted import P0, P1, N, planted_store

from detjac.analysis import jobs
from detjac.analysis.compare import compare, compare_report
from detjac.analysis.decoded import decode_report, decoded_rows
from detjac.errors import InvalidArgumentError


def _expected_left(store, pid, top, target=None):
    """Top tokens of u_1 by numpy: the SVD of [J_1 ... J_n], oriented along the output, through the unembedding
    (through W_U diag(g) for a layerwise target)."""
    prompt = store.get(pid)
    J = prompt.jacobian(lazy=False) if target is None else prompt.layerwise(target, lazy=False)
    U, _, _ = np.linalg.svd(J.reshape(J.shape[0], -1).astype(np.float64))
    output = prompt.array("output") if target is None else prompt.layerwise(target, "output")
    u = U[:, 0] * np.sign(U[:, 0] @ output)
    W = store.model_array("unembedding").astype(np.float64)
    if target is not None:
        W = W * store.model_array("final_norm")
    return np.argsort(-(W @ u), kind="stable")[:top].tolist()


def test_decode_report_decodes_the_planted_vectors_and_writes_figure_and_table(tmp_path):
    store = planted_store(tmp_path / "s.zarr", left=31, right=17, prompts=("one", "two"))
    plot, table = tmp_path / "d.svg", tmp_path / "d.csv"
    report = decode_report(store, [P0, P1], k=2, top=3, method="exact", plot=plot, table=table)
    assert report.written == [plot, table]
    first = report.spectra[0]
    assert (first.prompt_id, first.target, first.operator, first.token) == (P0, "output", "[J_1 ... J_n]", None)
    assert first.title == f"{P0} 'one' -> next '31'"
    lead = first.triplets[0]
    J = store.get(P0).jacobian(lazy=False).reshape(12, -1)
    assert lead.index == 1 and lead.sigma == pytest.approx(np.linalg.svd(J, compute_uv=False)[0], rel=1e-10)
    assert lead.left.split() == [f"{t}" for t in _expected_left(store, P0, 3)]
    assert lead.right.split()[0] == "17" and lead.right_token == 1 and lead.right_share > 0.99
    assert lead.cells() == ["1", f"{lead.sigma:.4g}", lead.left, f"[1] {lead.right}"]
    assert plot.read_text().lstrip().startswith("<?xml")
    with open(table, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 * 2 and rows[0]["target"] == "output" and rows[0]["token"] == "combined"
    assert rows[1]["index"] == "2" and json.loads(rows[0]["right_tokens"]) == lead.right.split()
    assert rows[0]["right_position"] == "1" and json.loads(rows[0]["left_ids"]) == _expected_left(store, P0, 3)
    assert store.read_analysis(P0, "svd_combined")[1]["params"]["method"] == "exact"  # kept in the store


def test_decode_report_of_one_token_and_of_a_layerwise_target(tmp_path):
    store = planted_store(tmp_path / "s.zarr", left=31, right=17, layer_from=0)
    token = decode_report(store, [P0], k=1, top=2, token=-2, method="exact").spectra[0]
    assert token.operator == "J_-2" and token.triplets[0].right_token == -2 and token.triplets[0].right_share == 1
    assert decoded_rows([token])[0]["token"] == "-2"
    layer = decode_report(store, [P0], k=1, top=2, target="layer.2", method="exact").spectra[0]
    assert layer.target == "layer.2" and layer.section()[0].endswith(": layer.2, [J_1 ... J_n]")
    assert layer.triplets[0].left.split() == [f"{t}" for t in _expected_left(store, P0, 2, "layer.2")]
    assert layer.triplets[0].left.split()[0] == "31"  # planted through the lens
    with pytest.raises(InvalidArgumentError, match="Expected a layerwise target"):
        decode_report(store, [P0], target="attn.1")


def test_dims_report_rows_and_table(tmp_path):
    store = planted_store(tmp_path / "s.zarr")
    report = jobs.dims_report(store, [P0], table=tmp_path / "dims.csv")
    assert report.rows == jobs.dims(store, [P0]) and report.table == tmp_path / "dims.csv"
    assert [r["token"] for r in report.rows] == ["combined", *range(N)]
    assert report.rows[0]["stable_rank"] < 1.01  # one planted direction carries the operator
    assert len(report.table.read_text().splitlines()) == 1 + 1 + N
    assert jobs.dims_report(store, [P0]).table is None


def test_compare_report_counts_hits_and_writes_plot_and_table(tmp_path):
    texts = ("one", "two", "three")
    det = planted_store(tmp_path / "d.zarr", prompts=texts)
    ordi = planted_store(tmp_path / "o.zarr", prompts=texts[1:], detach=False)
    report = compare_report(det, ordi, top=3, plot=tmp_path / "c.png", table=tmp_path / "c.csv")
    assert [r["prompt"] for r in report.rows] == ["two", "three"]  # matched by text
    assert report.hits == (sum(31 in _expected_left(det, pid, 3) for pid in (P1, f"{2:016x}")),
                           sum(31 in _expected_left(ordi, pid, 3) for pid in (P0, P1)))
    assert report.hits[0] == sum(r["detached_u1_hit"] for r in report.rows)
    assert report.rows[0]["ordinary_error"] == 0.3 and report.top == 3
    assert report.plot.read_bytes()[:4] == b"\x89PNG"
    header = report.table.read_text().splitlines()[0].split(",")
    assert "detached_error" in header and not any(h.endswith("spectrum") for h in header)
    assert compare_report(det, ordi, top=3, plot=tmp_path / "c2.png").table is None
    with pytest.raises(InvalidArgumentError, match="Expected a detached store first"):
        compare_report(ordi, det, plot=tmp_path / "c3.png")
    assert not (tmp_path / "c3.png").exists()
    assert len(compare(det, ordi, 3)) == 2
