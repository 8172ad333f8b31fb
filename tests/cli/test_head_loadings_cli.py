"""``--heads`` on the command line: ``detjac graph --heads N`` writes each loaded link's ``head_loadings``, ``detjac run
--graph --heads N`` keeps them in the store (sealed with the graph's other arrays, read back equal, exported), and bad
input is refused with one line before anything is written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.store import open_store

PROMPT = "Copper, n. A"
HEADS = 12


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    folder = tmp_path_factory.mktemp("heads-store")
    prompts = folder / "p.txt"
    prompts.write_text(PROMPT + "\n")
    result = invoke("run", "default", str(prompts), "--out", str(folder / "h.zarr"), "--graph", "--graph-max-nodes",
                    "40", "--heads", str(HEADS))
    assert result.exit_code == 0, result.output
    return folder, open_store(folder / "h.zarr")


def _loaded(data: dict) -> list[dict]:
    return [link for link in data["links"] if "head_loadings" in link]


def test_a_run_keeps_the_loadings_reads_them_back_and_exports_them(stored):
    folder, store = stored
    prompt = store.get(store.prompt_ids()[0])
    data = prompt.graph()
    loaded = _loaded(data)
    assert len(loaded) == HEADS
    strongest = sorted((abs(link["weight"]) for link in data["links"] if not link["source"].startswith("B_")),
                       reverse=True)[:HEADS]
    assert sorted((abs(link["weight"]) for link in loaded), reverse=True) == strongest
    for link in loaded:
        for row in link["head_loadings"].values():
            assert abs(sum(row.values()) - link["weight"]) <= 1e-11 * abs(link["weight"])
    arrays = prompt.graph_arrays()
    assert arrays["loaded_heads"].shape[0] == HEADS and arrays["loaded_link"].shape == (HEADS,)
    result = invoke("store", "export", str(folder / "h.zarr"), store.prompt_ids()[0], "--out", str(folder / "g.json"))
    assert result.exit_code == 0, result.output
    exported = json.loads((folder / "g.json").read_text())
    assert _loaded(exported) == loaded
    assert invoke("store", "verify", str(folder / "h.zarr")).exit_code == 0


def test_a_resume_with_other_heads_is_refused_by_name(stored, tmp_path):
    folder, _ = stored
    result = invoke("run", "default", str(folder / "p.txt"), "--out", str(folder / "h.zarr"), "--graph",
                    "--graph-max-nodes", "40", "--heads", str(HEADS + 1))
    assert result.exit_code != 0 and "heads" in result.output


def test_graph_writes_the_loadings(tmp_path):
    out = tmp_path / "g.json"
    result = invoke("graph", "-p", PROMPT, "--out", str(out), "--max-nodes", "40", "--heads", "5")
    assert result.exit_code == 0, result.output
    loaded = _loaded(json.loads(out.read_text()))
    assert len(loaded) == 5
    assert "5 links split by attention head" in result.output
    heads = {len(row) for link in loaded for row in link["head_loadings"].values()}
    assert heads == {5}  # the default model's 4 heads and the skip, every layer


@pytest.mark.parametrize("args, message", [
    (("--heads", "-1"), "Expected --heads to be a non-negative integer (links to split by attention head). Got -1."),
    (("--heads", "100000", "--max-nodes", "20"), "Expected --heads at most the pruned graph's"),
])
def test_bad_heads_are_refused_in_one_line_and_nothing_is_written(tmp_path, args, message):
    out = tmp_path / "g.json"
    result = invoke("graph", "-p", PROMPT, "--out", str(out), *args)
    assert result.exit_code != 0 and message in result.output
    assert [line for line in result.output.splitlines() if line.startswith("Error")] == \
        [next(line for line in result.output.splitlines() if message[:30] in line)]
    assert not out.exists() and not (tmp_path / "graph-metadata.json").exists()


def test_run_refuses_heads_without_graph_or_negative_before_any_store(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT + "\n")
    for args, message in ((("--heads", "3"), "Expected --heads with --graph"),
                          (("--graph", "--heads", "-2"), "Expected --heads to be a non-negative integer")):
        result = invoke("run", "default", str(prompts), "--out", str(tmp_path / "r.zarr"), *args)
        assert result.exit_code != 0 and message in result.output, result.output
        assert not (tmp_path / "r.zarr").exists()


def test_loaded_arrays_that_do_not_form_loadings_are_refused():
    from detjac.errors import StoreError
    from detjac.store.graph_tables import check_tables

    arrays = {name: np.zeros(0, dtype=dtype if dtype != "str" else str) for name, dtype in
              {"node_kind": "int8", "node_layer": "int64", "node_index": "int64", "node_position": "int64",
               "node_feature": "int64", "node_activation": "float64", "node_influence": "float64",
               "node_probability": "float64", "node_label": "str", "link_source": "int64", "link_target": "int64",
               "link_weight": "float64"}.items()}
    with pytest.raises(StoreError, match="both head-loading arrays"):
        check_tables({**arrays, "loaded_link": np.zeros(0, dtype=np.int64)})
    with pytest.raises(StoreError, match="distinct links among the graph's 0"):
        check_tables({**arrays, "loaded_link": np.zeros(1, dtype=np.int64), "loaded_heads": np.zeros((1, 2, 3))})
