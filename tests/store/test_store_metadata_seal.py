"""Every ``zarr.json`` a read depends on is checked against the seal when a prompt (or the model group) is opened,
and an analysis result never outlives the content it was computed from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from store_helpers import reseal

from detjac.cli.main import main
from detjac.store import open_store
from detjac.store.backend.sealed import write_sealed
from detjac.store.integrity import CorruptError
from detjac.store.testing import make_store


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("meta") / "s.zarr", prompts=2, targets=["layer.0"])


@pytest.fixture
def store(pristine, tmp_path):
    path = tmp_path / "s.zarr"
    shutil.copytree(pristine.path, path)
    return path


def _same_size_edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert len(old) == len(new) and text.count(old) >= 1
    path.write_text(text.replace(old, new, 1))


def _first(store: Path) -> tuple[str, Path]:
    pid = open_store(store).prompt_ids()[0]
    return pid, store / "prompts" / pid


def test_a_same_size_edit_of_a_jacobian_s_zarr_json_is_refused_on_open(store):
    pid, folder = _first(store)
    _same_size_edit(folder / "jacobian" / "zarr.json", '"separator": "/"', '"separator": "."')
    with pytest.raises(CorruptError, match=r"jacobian/zarr\.json changed since commit"):
        open_store(store).get(pid)
    result = invoke("analyze", "svd", store, "--prompt-id", pid, "--k", "2")
    assert result.exit_code != 0 and "jacobian/zarr.json changed since commit" in result.output
    assert not (store / "analysis" / pid).exists()  # nothing computed from it is cached


def test_a_changed_shape_digit_of_a_layerwise_array_is_refused_on_open(store):
    pid, folder = _first(store)
    meta = folder / "layerwise" / "layer.0" / "jacobian" / "zarr.json"
    _same_size_edit(meta, "\n    8,\n", "\n    7,\n")
    with pytest.raises(CorruptError, match=r"layerwise/layer\.0/jacobian/zarr\.json changed since commit"):
        open_store(store).get(pid)


def test_a_same_size_edit_of_a_model_array_s_shape_is_refused(store):
    """The values' SHA-256 stays the same when the same bytes are read with another shape."""
    meta = store / "model" / "embedding" / "zarr.json"
    shape = json.loads(meta.read_text())["shape"]
    assert shape == [40, 8]
    _same_size_edit(meta, "\n    40,\n    8\n", "\n    80,\n    4\n")
    with pytest.raises(CorruptError, match=r"model/embedding/zarr\.json of .* Got different bytes"):
        open_store(store).model_array("embedding")


def test_an_analysis_result_does_not_outlive_the_prompt_content_it_was_computed_from(store):
    pid, folder = _first(store)
    opened = open_store(store)
    opened.analyses.write(pid, "svd_combined", {"S": np.ones(2)}, {"k": 2})
    assert opened.analyses.read(pid, "svd_combined")[0]["S"].tolist() == [1.0, 1.0]
    # the prompt's content changes and is sealed again (a prompt rewritten): the result is stale
    meta = json.loads((folder / "zarr.json").read_text())
    meta["attributes"]["prompt"] += " again"
    (folder / "zarr.json").write_text(json.dumps(meta))
    reseal(folder)
    assert open_store(store).analyses.read(pid, "svd_combined") is None
    assert any("computed from other content" in (r.reason or "") for r in open_store(store).verify())


def test_a_result_that_records_no_source_is_computed_again(store):
    """Results cached by a detjac that did not record their source may hold zeros read through damaged metadata."""
    pid, _ = _first(store)
    folder = store / "analysis"
    for group in (folder, folder / pid):
        group.mkdir()
        (group / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    write_sealed(folder / pid, "svd_combined", {"S": np.zeros(2)}, {"k": 2}, "write")
    assert open_store(store).analyses.read(pid, "svd_combined") is None
