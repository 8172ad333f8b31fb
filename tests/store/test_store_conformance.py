"""What every store backend must do (store/base.py); add a backend to BACKENDS to run it through."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from detjac.errors import InvalidArgumentError, StoreError
from detjac.store import JacobianStore, create_store, open_store, prompt_id

RUN = {"model_id": "m", "model_type": "llama", "config_sha256": "c", "revision": None, "dtype": "float64",
       "keep": "full", "detach": True, "position": -1, "target": "hidden", "row_block": 3}

# name -> (open for writing, open for reading)
BACKENDS = {"zarr-directory": (lambda path: create_store(path, RUN), open_store)}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, tmp_path):
    writer_factory, reader_factory = BACKENDS[request.param]
    path = tmp_path / "store"
    store = writer_factory(path)
    yield store, lambda: reader_factory(path)
    store.close()


def random_prompt(seed: int, rows: int = 7, n: int = 3, d: int = 5):
    rng = np.random.default_rng(seed)
    J, x = rng.standard_normal((rows, n, d)), rng.standard_normal((n, d))
    return J, x, np.einsum("rtc,tc->r", J, x)


def put(store: JacobianStore, pid: str, seed: int = 0, block: int = 3, commit: bool = True):
    J, x, y = random_prompt(seed)
    writer = store.begin(pid, n_rows=J.shape[0], n_tokens=J.shape[1], n_cols=J.shape[2], dtype="float64",
                         row_block=block)
    for start in range(0, J.shape[0], block):
        writer.write_rows(start, min(start + block, J.shape[0]), J[start:start + block])
    writer.write_array("embeddings", x)
    writer.write_array("output", y)
    writer.write_array("token_ids", np.arange(J.shape[1]))
    if commit:
        writer.commit({"prompt": f"text of {pid}", "n_tokens": J.shape[1], "reconstruction_error": 0.0,
                       "dtype": "float64", "tag": seed})
    return writer, J, x, y


def test_committed_prompt_reads_back_exactly(backend):
    store, reader = backend
    _, J, x, y = put(store, "a", seed=1)
    prompt = reader().get("a")
    assert np.array_equal(prompt.jacobian(lazy=False), J)
    assert np.array_equal(np.asarray(prompt.jacobian().compute()), J)
    assert np.array_equal(prompt.array("embeddings"), x) and np.array_equal(prompt.array("output"), y)
    assert np.array_equal(prompt.operator(1), J[:, 1, :]) and np.array_equal(prompt.operator(-1), J[:, 2, :])
    assert prompt.attrs["tag"] == 1 and prompt.attrs["complete"] is True and prompt.n_tokens == 3


def test_prompt_is_invisible_until_commit(backend):
    store, reader = backend
    writer, *_ = put(store, "b", commit=False)
    assert "b" not in reader() and reader().prompt_ids() == []
    writer.commit({"prompt": "b", "n_tokens": 3, "reconstruction_error": 0.0, "dtype": "float64"})
    assert reader().prompt_ids() == ["b"]


def test_abort_leaves_nothing(backend):
    store, reader = backend
    with pytest.raises(RuntimeError):
        with store.begin("c", n_rows=7, n_tokens=3, n_cols=5, dtype="float64", row_block=3) as writer:
            writer.write_rows(0, 3, np.zeros((3, 3, 5)))
            raise RuntimeError("engine failed")
    assert reader().prompt_ids() == []


def test_rows_must_arrive_in_order_and_complete(backend):
    store, _ = backend
    writer = store.begin("d", n_rows=7, n_tokens=3, n_cols=5, dtype="float64", row_block=3)
    with pytest.raises(StoreError, match="Expected jacobian rows starting at 0"):
        writer.write_rows(3, 6, np.zeros((3, 3, 5)))
    writer.write_rows(0, 3, np.zeros((3, 3, 5)))
    with pytest.raises(StoreError, match="Expected every array of prompt d before commit"):
        writer.commit({"prompt": "d"})


def test_listing_filters_and_unknown_ids(backend):
    store, reader = backend
    for i, pid in enumerate(["x1", "x2", "y1"]):
        put(store, pid, seed=i)
    r = reader()
    assert r.prompt_ids() == ["x1", "x2", "y1"] and len(r) == 3
    assert [p.id for p in r.prompts(contains="of x")] == ["x1", "x2"]
    assert [p.id for p in r.prompts(where=lambda a: a["tag"] >= 1)] == ["x2", "y1"]
    with pytest.raises(StoreError, match="Expected a complete prompt 'zz'"):
        r.get("zz")
    with pytest.raises(InvalidArgumentError, match=r"Expected a token index in \[-3, 3\)"):
        r.get("x1").operator(3)
    with pytest.raises(InvalidArgumentError, match="Expected one of embeddings, output, token_ids. Got .jacobian."):
        r.get("x1").array("jacobian")


def test_verify_reports_each_prompt(backend):
    store, reader = backend
    put(store, "v1", seed=3)
    put(store, "v2", seed=4)
    results = reader().verify()
    assert [r.id for r in results] == ["v1", "v2"] and all(r.ok for r in results)
    assert max(r.reconstruction_error for r in results) < 1e-14


def test_duplicate_commit_keeps_the_first(backend):
    store, reader = backend
    put(store, "dup", seed=5)
    put(store, "dup", seed=6)
    assert reader().get("dup").attrs["tag"] == 5


def test_prompt_ids_are_stable_and_depend_on_the_run():
    assert prompt_id(RUN, "hello") == prompt_id(dict(RUN), "hello")
    assert prompt_id(RUN, "hello") != prompt_id(RUN, "hello ")
    assert prompt_id(RUN, "hello") != prompt_id(dict(RUN, dtype="float32"), "hello")
    assert prompt_id(RUN, "hello") == prompt_id(dict(RUN, row_block=64), "hello")  # chunking is not identity


@pytest.mark.parametrize("shard_bytes, shard_rows", [(None, 12), (2 * 3 * 3 * 5 * 8, 6), (1, 3)])
def test_rows_in_any_pieces_fill_whole_shards(backend, shard_bytes, shard_rows):
    """Blocks of any size go into shards of whole row blocks, at most ``shard_bytes`` each (one block at least)."""
    import zarr

    store, reader = backend
    J, x, y = random_prompt(3, rows=11)
    writer = store.begin("s", n_rows=11, n_tokens=3, n_cols=5, dtype="float64", row_block=3, shard_bytes=shard_bytes)
    bounds = [0, 2, 7, 8, 11]  # pieces of 2, 5, 1 and 3 rows, across shard boundaries
    for a, b in itertools.pairwise(bounds):
        writer.write_rows(a, b, J[a:b])
    writer.write_array("embeddings", x)
    writer.write_array("output", y)
    writer.write_array("token_ids", np.arange(3))
    writer.commit({"prompt": "s", "n_tokens": 3, "reconstruction_error": 0.0, "dtype": "float64"})
    assert np.array_equal(reader().get("s").jacobian(lazy=False), J)
    if store.path.is_dir():
        assert zarr.open_array(store.path / "prompts" / "s" / "jacobian", mode="r").shards == (shard_rows, 3, 5)


def test_bad_rows_and_shard_sizes_are_refused(backend):
    store, reader = backend
    with pytest.raises(StoreError, match="Expected shard_bytes to be a positive integer or None. Got 0"):
        store.begin("e", n_rows=7, n_tokens=3, n_cols=5, dtype="float64", row_block=3, shard_bytes=0)
    writer = store.begin("e", n_rows=7, n_tokens=3, n_cols=5, dtype="float64", row_block=3)
    with pytest.raises(StoreError, match=r"Expected jacobian rows of shape \(rows, 3, 5\) for prompt e. "
                                         r"Got values of shape \(3, 1, 5\)"):
        writer.write_rows(0, 3, np.zeros((3, 1, 5)))  # would broadcast
    writer.abort()
    assert reader().prompt_ids() == []
