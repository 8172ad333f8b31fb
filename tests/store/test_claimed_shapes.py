"""Shapes claimed in metadata edited and resealed are held against the rest of the group before
anything is allocated: a Jacobian wider than the prompt's embeddings, graph tables of 1e11 rows, a saved lens of
(4, 1e5, 1e5) are one line, never a MemoryError or a reshape traceback."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from store_helpers import reseal

from detjac.analysis import Lens, load_lens, save_lens
from detjac.cli.main import main
from detjac.store import open_store
from detjac.store.integrity import CorruptError
from detjac.store.testing import make_store, synthetic_graph


def _claim(array_folder, shape, chunks=None):
    meta_file = array_folder / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["shape"] = shape
    meta["chunk_grid"]["configuration"]["chunk_shape"] = chunks or shape
    meta_file.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("claimed") / "s.zarr", prompts=2,
                      graphs=lambda truth: synthetic_graph(truth, [(0, 3, 1), (1, 5, 2)]))


@pytest.fixture
def store(pristine, tmp_path):
    shutil.copytree(pristine.path, tmp_path / "s.zarr")
    return tmp_path / "s.zarr", sorted(pristine.prompts)[0]


def test_a_jacobian_claiming_a_billion_columns_is_refused_on_open(store):
    path, pid = store
    folder = path / "prompts" / pid
    rows, n, d = json.loads((folder / "jacobian" / "zarr.json").read_text())["shape"]
    _claim(folder / "jacobian", [rows, n, 10**9], [rows, n, 10**9])
    reseal(folder)
    with pytest.raises(CorruptError, match=f"Got jacobian claiming shape \\[{rows}, {n}, 1000000000\\]: its col "
                                           f"dimension has 1000000000, other arrays have {d}"):
        open_store(path).get(pid)
    result = CliRunner().invoke(main, ["analyze", "svd", str(path), "--prompt-id", pid])
    assert result.exit_code == 1 and "claiming shape" in result.output and "Traceback" not in result.output


def test_embeddings_and_jacobian_claiming_the_same_width_are_bounded_by_memory(store):
    path, pid = store
    folder = path / "prompts" / pid
    rows, n, _ = json.loads((folder / "jacobian" / "zarr.json").read_text())["shape"]
    _claim(folder / "jacobian", [rows, n, 10**12], [rows, n, 10**12])  # the variant: consistent everywhere
    _claim(folder / "embeddings", [n, 10**12])
    for name in ("layerwise",):
        shutil.rmtree(folder / name, ignore_errors=True)
    reseal(folder)
    with pytest.raises(CorruptError, match="Got a chunk claiming .* GiB, more than this machine's"):
        open_store(path).get(pid)


def test_graph_tables_claiming_1e11_rows_are_refused_before_reading(store):
    path, pid = store
    folder = path / "prompts" / pid
    for name in ("node_kind", "node_layer", "node_index", "node_position", "node_feature", "node_activation",
                 "node_influence", "node_probability", "node_label"):
        _claim(folder / "graph" / name, [10**11])
    reseal(folder)
    with pytest.raises(CorruptError, match="Got a chunk claiming 745.1 GiB, more than this machine's"):
        open_store(path).get(pid)
    _claim(folder / "graph" / "node_kind", [7])  # the variant: one table of another length than the others
    for name in ("node_layer", "node_index", "node_position", "node_feature", "node_activation", "node_influence",
                 "node_probability", "node_label"):
        _claim(folder / "graph" / name, [6])
    reseal(folder)
    with pytest.raises(CorruptError, match="Got graph/node_kind claiming shape \\[7\\]: its node dimension has 7, "
                                           "other arrays have 6"):
        open_store(path).get(pid)


def test_a_saved_lens_claiming_a_huge_width_is_refused_before_reading(tmp_path):
    d = 8
    lens = Lens(np.arange(4), np.zeros((4, d, d)), np.zeros((4, d, d)), np.ones(4, dtype=np.int64),
                {"version": 1, "kind": "detached", "target": "final_block"})
    saved = save_lens(lens, tmp_path / "l.jlens")
    for name in ("mean", "second_moment"):
        _claim(saved / name, [4, 10**5, 10**5])
    reseal(saved)
    with pytest.raises(CorruptError, match="Got arrays claiming .* GiB, more than this machine's"):
        load_lens(saved)
    result = CliRunner().invoke(main, ["lens", "apply", str(saved), "--prompt", "Oak, n. A tree", "--no-exact"])
    assert result.exit_code == 1 and "GiB, more than this machine's" in result.output, result.output
