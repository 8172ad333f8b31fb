"""A store is readable by other zarr v3 implementations than zarr-python: TensorStore reads every numeric array
bit-equal, and every ``zarr.json`` is standard JSON (what strict parsers such as JavaScript's ``JSON.parse``
accept). ``token_text`` uses zarr-python's ``string`` extension data type: the docs say so and where else the
pieces are; this test keeps both claims true."""

from __future__ import annotations

import json

import numpy as np
import pytest

from detjac.store import open_store
from detjac.store.testing import make_store

ts = pytest.importorskip("tensorstore", reason="tensorstore is not installed (pip install tensorstore, in the test "
                                               "extra): the store is not read with an independent zarr v3 reader")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("readers") / "s.zarr", prompts=2, d_model=6, n_tokens=4, n_layers=2,
                      targets=("layer.1",))


def read_with_tensorstore(path) -> np.ndarray:
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}, open=True).result().read() \
        .result()


def test_tensorstore_reads_every_numeric_array_bit_equal(store):
    import zarr

    root = store.path
    arrays = [p.parent for p in root.rglob("zarr.json") if json.loads(p.read_text()).get("node_type") == "array"]
    numeric = [a for a in arrays if a.name != "token_text"]
    assert len(numeric) >= 12  # jacobians, embeddings, outputs, token ids, layerwise, model matrices, ...
    for folder in numeric:
        mine = zarr.open_array(str(folder), mode="r")[...]
        theirs = read_with_tensorstore(folder)
        assert theirs.dtype == mine.dtype and theirs.shape == mine.shape, folder
        assert np.array_equal(theirs.view(np.uint8), np.ascontiguousarray(mine).view(np.uint8)), folder


def test_every_zarr_json_is_standard_json_and_the_tokens_are_in_the_attributes(store):
    import zarr

    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    for meta in store.path.rglob("zarr.json"):
        json.loads(meta.read_text(), parse_constant=refuse)
    texts = [(prompt, prompt.path / "token_text") for prompt in open_store(store.path)]
    assert texts and all(path.is_dir() for _, path in texts)
    for prompt, path in texts:  # zarr-python's string extension: TensorStore refuses it, as the docs say
        with pytest.raises(ValueError, match="string"):
            read_with_tensorstore(path)
        assert list(prompt.attrs["tokens"]) == [str(t) for t in zarr.open_array(str(path), mode="r")[...]]
