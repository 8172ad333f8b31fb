"""What every store backend must do (store/reader.py, store/writer.py); add a backend to BACKENDS to run it through.

Each test goes through the interfaces only (``StoreReader``, ``StoreWriter``, ``StoredPrompt``,
``PromptWriter``, ``AnalysisCache``); the prompts come from ``detjac.store.testing``, whose arrays are exact.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from detjac.errors import InvalidArgumentError, StoreError
from detjac.store import (
    AnalysisCache,
    JacobianStore,
    LayerwiseSpec,
    MemoryAnalyses,
    StoreReader,
    StoreWriter,
    attach_store,
    create_store,
    open_store,
    prompt_id,
)
from detjac.store.testing import (
    layer_targets,
    make_store,
    run_description,
    synthetic_model,
    synthetic_prompt,
    write_prompt,
)

RUN = {"model_id": "m", "model_type": "llama", "config_sha256": "c", "revision": None, "dtype": "float64",
       "keep": "full", "detach": True, "position": -1, "target": "hidden", "row_block": 3}
MODEL = synthetic_model(d_model=6, vocab=30, seed=3)
# Prompt ids are 16 hex digits; these keep the order of their names.
ID = {"a": "a" * 16, "b": "b" * 16, "c": "c" * 16, "d": "d" * 16, "e": "e" * 16, "x1": "1" * 15 + "1",
      "x2": "1" * 15 + "2", "y1": "2" * 15 + "1", "zz": "f" * 16, "v1": "0" * 15 + "1", "v2": "0" * 15 + "2",
      "dup": "d0" * 8, "s": "5" * 16, "n": "9" * 16, "q": "7" * 16, "t": "7" * 15 + "0"}
NAMES = {pid: name for name, pid in ID.items()}
F, LW, WRONG, LIAR = "0f" * 8, "0b" * 8, "0a" * 8, "0c" * 8


@dataclass(frozen=True)
class Backend:
    """How to reach one backend: create (or resume) a store for writing, open one for reading, attach a worker."""

    create: Any  # (path, run, model_data) -> JacobianStore opened for writing
    open: Any  # path -> JacobianStore
    attach: Any  # (path, lease) -> JacobianStore writing under the run's lease


BACKENDS = {"zarr-directory": Backend(lambda path, run, data=None: create_store(path, run, model_data=data),
                                      open_store, attach_store)}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, tmp_path):
    impl = BACKENDS[request.param]
    path = tmp_path / "store"
    store = impl.create(path, RUN, lambda: MODEL.model_data("float64"))
    yield store, lambda: impl.open(path)
    store.close()


@pytest.fixture(params=sorted(BACKENDS))
def impl(request):
    return BACKENDS[request.param]


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
        writer.commit({"prompt": f"text of {NAMES.get(pid, pid)}", "n_tokens": J.shape[1], "reconstruction_error": 0.0,
                       "dtype": "float64", "tag": seed})
    return writer, J, x, y


def test_committed_prompt_reads_back_exactly(backend):
    store, reader = backend
    _, J, x, y = put(store, ID["a"], seed=1)
    prompt = reader().get(ID["a"])
    assert np.array_equal(prompt.jacobian(lazy=False), J)
    assert np.array_equal(np.asarray(prompt.jacobian().compute()), J)
    assert np.array_equal(prompt.array("embeddings"), x) and np.array_equal(prompt.array("output"), y)
    assert np.array_equal(prompt.operator(1), J[:, 1, :]) and np.array_equal(prompt.operator(-1), J[:, 2, :])
    assert prompt.attrs["tag"] == 1 and prompt.attrs["complete"] is True and prompt.n_tokens == 3
    assert reader().prompt_attrs(ID["a"]) == prompt.attrs


def test_prompt_attrs_of_a_missing_prompt_is_refused_like_get(backend):
    store, reader = backend
    put(store, ID["a"])
    put(store, ID["b"], commit=False)
    for missing in (ID["b"], ID["zz"]):
        with pytest.raises(StoreError, match=f"Expected a complete prompt '{missing}'"):
            reader().prompt_attrs(missing)
    with pytest.raises(InvalidArgumentError, match="Expected a prompt id of 16 hex digits"):
        reader().prompt_attrs("../model")


def test_prompt_is_invisible_until_commit(backend):
    store, reader = backend
    writer, *_ = put(store, ID["b"], commit=False)
    assert ID["b"] not in reader() and reader().prompt_ids() == []
    writer.commit({"prompt": "text of b", "n_tokens": 3, "reconstruction_error": 0.0, "dtype": "float64"})
    assert reader().prompt_ids() == [ID["b"]]


def test_abort_leaves_nothing(backend):
    store, reader = backend
    with pytest.raises(RuntimeError):
        with store.begin(ID["c"], n_rows=7, n_tokens=3, n_cols=5, dtype="float64", row_block=3) as writer:
            writer.write_rows(0, 3, np.zeros((3, 3, 5)))
            raise RuntimeError("engine failed")
    assert reader().prompt_ids() == []


def test_rows_must_arrive_in_order_and_complete(backend):
    store, _ = backend
    writer = store.begin(ID["d"], n_rows=7, n_tokens=3, n_cols=5, dtype="float64", row_block=3)
    with pytest.raises(StoreError, match="Expected jacobian rows starting at 0"):
        writer.write_rows(3, 6, np.zeros((3, 3, 5)))
    writer.write_rows(0, 3, np.zeros((3, 3, 5)))
    with pytest.raises(StoreError, match="Expected every array of prompt d{16} before commit"):
        writer.commit({"prompt": "text of d"})


def test_listing_filters_and_unknown_ids(backend):
    store, reader = backend
    for i, pid in enumerate([ID["x1"], ID["x2"], ID["y1"]]):
        put(store, pid, seed=i)
    r = reader()
    assert r.prompt_ids() == [ID["x1"], ID["x2"], ID["y1"]] and len(r) == 3
    assert [p.id for p in r.prompts(contains="of x")] == [ID["x1"], ID["x2"]]
    assert [p.id for p in r.prompts(where=lambda a: a["tag"] >= 1)] == [ID["x2"], ID["y1"]]
    with pytest.raises(StoreError, match="Expected a complete prompt 'f{16}'"):
        r.get(ID["zz"])
    with pytest.raises(InvalidArgumentError, match=r"Expected a token index in \[-3, 3\)"):
        r.get(ID["x1"]).operator(3)
    with pytest.raises(InvalidArgumentError, match="Expected one of embeddings, output, token_ids. Got .jacobian."):
        r.get(ID["x1"]).array("jacobian")


def test_verify_reports_each_prompt(backend):
    store, reader = backend
    put(store, ID["v1"], seed=3)
    put(store, ID["v2"], seed=4)
    results = reader().verify()
    prompts = [r for r in results if r.kind == "prompt"]
    assert [r.id for r in prompts] == [ID["v1"], ID["v2"]] and all(r.ok for r in results)
    assert max(r.reconstruction_error for r in prompts) < 1e-14
    assert {r.id for r in results if r.kind == "model"} == {"model/embedding", "model/unembedding",
                                                          "model/final_norm", "model/tokenizer.json"}


def test_duplicate_commit_keeps_the_first(backend):
    store, reader = backend
    put(store, ID["dup"], seed=5)
    put(store, ID["dup"], seed=6)
    assert reader().get(ID["dup"]).attrs["tag"] == 5


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
    writer = store.begin(ID["s"], n_rows=11, n_tokens=3, n_cols=5, dtype="float64", row_block=3,
                         shard_bytes=shard_bytes)
    bounds = [0, 2, 7, 8, 11]  # pieces of 2, 5, 1 and 3 rows, across shard boundaries
    for a, b in itertools.pairwise(bounds):
        writer.write_rows(a, b, J[a:b])
    writer.write_array("embeddings", x)
    writer.write_array("output", y)
    writer.write_array("token_ids", np.arange(3))
    writer.commit({"prompt": "text of s", "n_tokens": 3, "reconstruction_error": 0.0, "dtype": "float64"})
    assert np.array_equal(reader().get(ID["s"]).jacobian(lazy=False), J)
    if store.path.is_dir():
        assert zarr.open_array(store.path / "prompts" / ID["s"] / "jacobian", mode="r").shards == (shard_rows, 3, 5)


def test_bad_rows_and_shard_sizes_are_refused(backend):
    store, reader = backend
    with pytest.raises(StoreError, match="Expected shard_bytes to be a positive integer or None. Got 0"):
        store.begin(ID["e"], n_rows=7, n_tokens=3, n_cols=5, dtype="float64", row_block=3, shard_bytes=0)
    writer = store.begin(ID["e"], n_rows=7, n_tokens=3, n_cols=5, dtype="float64", row_block=3)
    with pytest.raises(StoreError, match=r"Expected jacobian rows of shape \(rows, 3, 5\) for prompt e{16}. "
                                         r"Got values of shape \(3, 1, 5\)"):
        writer.write_rows(0, 3, np.zeros((3, 1, 5)))  # would broadcast
    writer.abort()
    assert reader().prompt_ids() == []


def _synthetic(impl: Backend, path, **settings):
    """A store of ``impl`` opened for writing with a synthetic run, and a function writing one prompt into it."""
    run = run_description(MODEL, n_layers=2, row_block=2, **settings)
    store = impl.create(path, run, lambda: MODEL.model_data("float64"))

    def put_text(text: str, targets=(), affine: bool = False, token_block: int = 1):
        truth = synthetic_prompt(MODEL, run, text, n_layers=2, targets=targets, affine=affine)
        write_prompt(store, MODEL, run, truth, token_block=token_block)
        return truth

    return store, put_text


def test_run_description_and_metadata(impl, tmp_path):
    run = run_description(MODEL, n_layers=2)
    with impl.create(tmp_path / "s", run) as store:
        assert store.run == run and store.format_version == 2 and store.lease is not None
    reader = impl.open(tmp_path / "s")
    assert reader.run == run and isinstance(reader.created, str) and reader.created[:2] == "20"
    assert reader.lease is None and len(reader) == 0 and list(reader) == []


def test_model_arrays_and_files_are_kept_for_decoding(backend):
    _, reader = backend
    r = reader()
    assert np.array_equal(r.model_array("embedding"), MODEL.embedding)
    assert np.array_equal(r.model_array("unembedding"), MODEL.unembedding)
    assert np.array_equal(r.model_array("final_norm"), MODEL.final_norm)
    with pytest.raises(StoreError, match="Expected a model array 'lm_head'"):
        r.model_array("lm_head")
    assert r.model_bytes("tokenizer.json").decode() == MODEL.tokenizer_json()
    with pytest.raises(InvalidArgumentError, match="Expected one of tokenizer.json. Got 'vocab.txt'"):
        r.model_bytes("vocab.txt")


class _Rows:
    """A matrix handed out in row slices only, like an engine reading a vocabulary-sized matrix from its weights."""

    def __init__(self, values):
        self.values, self.shape, self.dtype, self.blocks = values, values.shape, values.dtype, []

    def __getitem__(self, index):
        assert isinstance(index, slice)
        self.blocks.append(len(range(*index.indices(self.shape[0]))))
        return self.values[index]


def test_model_matrices_given_as_row_readers_are_copied_in_blocks_never_whole(impl, tmp_path):
    rng = np.random.default_rng(5)
    embedding, unembedding = rng.standard_normal((20000, 3)), rng.standard_normal((20000, 3)).astype(np.float32)
    readers = {"embedding": _Rows(embedding), "unembedding": _Rows(unembedding)}
    impl.create(tmp_path / "rows", RUN, lambda: (dict(readers), {})).close()
    impl.create(tmp_path / "whole", RUN, lambda: ({"embedding": embedding, "unembedding": unembedding}, {})).close()
    rows, whole = impl.open(tmp_path / "rows"), impl.open(tmp_path / "whole")
    for name, values in (("embedding", embedding), ("unembedding", unembedding)):
        got = rows.model_array(name)
        assert got.dtype == values.dtype and np.array_equal(got, values)
        assert np.array_equal(whole.model_array(name), got)
        assert sum(readers[name].blocks) == 20000 and max(readers[name].blocks) < 20000, readers[name].blocks
    assert rows.run == whole.run  # model_array checked each against its sealed SHA-256 of the whole matrix


def test_a_model_matrix_whose_rows_come_back_in_the_wrong_shape_is_refused(impl, tmp_path):
    class Short(_Rows):
        def __getitem__(self, index):
            return super().__getitem__(index)[:-1]

    with pytest.raises(StoreError, match=r"Expected rows 0:\d+ of 'embedding' with shape \(\d+, 3\). Got \(\d+, 3\)"):
        impl.create(tmp_path / "s", RUN, lambda: ({"embedding": Short(np.zeros((20, 3)))}, {}))
    assert list(tmp_path.iterdir()) == []  # neither the store nor its temporary folder


def test_a_store_without_model_data_says_so(impl, tmp_path):
    impl.create(tmp_path / "s", RUN).close()
    with pytest.raises(StoreError, match="Got none .stores written without the model's matrices cannot decode"):
        impl.open(tmp_path / "s").model_array("embedding")


def test_analysis_results_round_trip_and_are_replaced(backend):
    store, reader = backend
    put(store, ID["a"], seed=1)
    assert reader().read_analysis(ID["a"], "svd_combined") is None and reader().analysis_names(ID["a"]) == []
    arrays = {"U": np.arange(6.0).reshape(3, 2), "S": np.array([2.0, 1.0])}
    store.write_analysis(ID["a"], "svd_combined", arrays, {"params": {"k": 2}, "token": None})
    got, attrs = reader().read_analysis(ID["a"], "svd_combined")
    assert sorted(got) == ["S", "U"] and all(np.array_equal(got[k], v) for k, v in arrays.items())
    assert attrs["params"] == {"k": 2} and attrs["token"] is None and "written_at" in attrs
    store.write_analysis(ID["a"], "svd_combined", {"S": np.array([3.0])}, {"params": {"k": 1}})
    got, attrs = reader().read_analysis(ID["a"], "svd_combined")
    assert list(got) == ["S"] and got["S"].tolist() == [3.0] and attrs["params"] == {"k": 1}
    assert reader().read_analysis(ID["a"], "spectrum_combined") is None
    store.write_analysis(ID["a"], "layers_layer.1", {"S": np.array([1.0])}, {})
    assert reader().analysis_names(ID["a"]) == ["layers_layer.1", "svd_combined"]
    with pytest.raises(StoreError, match="Expected a complete prompt 'f{16}'"):
        store.write_analysis(ID["zz"], "svd_combined", arrays, {})


def test_reading_and_writing_are_two_interfaces(backend):
    """What the analyses and the viewer use is the reader; the writer adds prompts, failures, staging and the lens.
    A handle opened to read keeps analysis results (derived data) but refuses to write prompts."""
    store, reader = backend
    assert isinstance(store, StoreWriter) and isinstance(reader(), StoreReader) and JacobianStore is StoreWriter
    writing = {"begin", "record_failure", "clear_staging", "discard", "write_lens", "remove_lens", "writing"}
    assert writing.isdisjoint(dir(StoreReader)) and writing <= set(dir(StoreWriter))
    assert isinstance(reader().analyses, AnalysisCache)
    put(store, ID["a"], seed=1)
    reader().analyses.write(ID["a"], "svd_combined", {"S": np.array([2.0])}, {"params": {"k": 1}})
    assert store.analyses.read(ID["a"], "svd_combined")[0]["S"].tolist() == [2.0]
    with pytest.raises(StoreError, match="Expected a store opened for writing"):
        reader().begin(ID["b"], n_rows=1, n_tokens=1, n_cols=1, dtype="float64", row_block=1)


def test_results_kept_in_memory_over_a_store_never_reach_it(backend):
    """MemoryAnalyses (what ``detjac view`` gives the analyses): its writes stay in memory, its reads fall back to
    the store's own results, which it never changes."""
    store, reader = backend
    put(store, ID["a"], seed=1)
    store.analyses.write(ID["a"], "svd_combined", {"S": np.array([2.0])}, {"params": {"k": 1}})
    memory = MemoryAnalyses(reader().analyses)
    assert memory.read(ID["a"], "svd_combined")[0]["S"].tolist() == [2.0]  # read through
    memory.write(ID["a"], "svd_combined", {"S": np.array([5.0])}, {"params": {"k": 9}})
    memory.write(ID["a"], "spectrum_combined", {"S": np.array([1.0])}, {})
    assert memory.read(ID["a"], "svd_combined")[1] == {"params": {"k": 9}}
    assert memory.names(ID["a"]) == ["spectrum_combined", "svd_combined"] and memory.names(ID["b"]) == []
    assert reader().analyses.names(ID["a"]) == ["svd_combined"]
    assert reader().analyses.read(ID["a"], "svd_combined")[0]["S"].tolist() == [2.0]


def test_lens_groups_round_trip_and_are_replaced(backend):
    store, reader = backend
    assert reader().lens_names() == [] and reader().read_lens("fitted") is None
    mean = np.arange(4.0).reshape(1, 2, 2)
    store.write_lens("fitted", {"mean": mean}, {"n": 1}, {"mean": ("layer", "row", "col")})
    arrays, attrs = reader().read_lens("fitted")
    assert np.array_equal(arrays["mean"], mean) and attrs["n"] == 1 and "written_at" in attrs
    assert reader().read_lens("fitted", arrays=False) == ({}, attrs)
    store.write_lens("partial-0-x", {"sum": np.ones((2, 2))}, {"n": 2})
    store.write_lens("fitted", {"mean": 2 * mean}, {"n": 3})
    assert reader().lens_names() == ["fitted", "partial-0-x"] and reader().read_lens("fitted")[1]["n"] == 3
    store.remove_lens("partial-0-x")
    store.remove_lens("partial-0-x")  # nothing left to remove: nothing happens
    assert reader().lens_names() == ["fitted"]


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_layerwise_jacobians_read_back_with_what_they_reconstruct(impl, tmp_path, mode):
    store, put_text = _synthetic(impl, tmp_path / "s", targets=["layer.1", "mlp_local.0"], mode=mode)
    targets = layer_targets(2, "layer,attn,mlp,mlp_local")
    truth = put_text("the oak tree grows", targets, token_block=3)
    store.close()
    prompt = impl.open(tmp_path / "s").get(truth.id)
    assert prompt.layerwise_targets == ["attn.0", "layer.0", "mlp.0", "mlp_local.0",
                                        "attn.1", "layer.1", "mlp.1", "mlp_local.1"]
    for name, t in truth.layerwise.items():
        assert np.array_equal(np.asarray(prompt.layerwise(name).compute()), t.jacobian)
        assert np.array_equal(prompt.layerwise(name, lazy=False), t.jacobian)
        assert np.array_equal(prompt.layerwise(name, "output"), t.output)
        info = prompt.layerwise_info(name)
        assert (info["layer"], info["component"], info["mode"]) == (int(name[-1]), name.split(".")[0].split("_")[0],
                                                                    mode)
        assert info["local"] is name.startswith("mlp_local") and info["reconstruction_error"] < 1e-14
        if info["local"]:
            assert np.array_equal(prompt.layerwise(name, "inputs"), t.inputs)
    with pytest.raises(InvalidArgumentError, match=r"Expected a layerwise target of prompt .* \(attn.0, layer.0, "
                                                   r".*\). Got 'layer.7'"):
        prompt.layerwise("layer.7")
    with pytest.raises(InvalidArgumentError, match="Expected one of jacobian, output for layer.0. Got 'inputs'"):
        prompt.layerwise("layer.0", "inputs")
    with pytest.raises(InvalidArgumentError, match="Got 'layer.7'"):
        prompt.layerwise_info("layer.7")
    assert all(r.ok for r in impl.open(tmp_path / "s").verify())


def test_a_prompt_without_layerwise_jacobians_has_none(backend):
    store, reader = backend
    put(store, ID["a"])
    prompt = reader().get(ID["a"])
    assert prompt.layerwise_targets == [] and not prompt.low_rank and prompt.bias() is None
    with pytest.raises(InvalidArgumentError, match="none stored"):
        prompt.layerwise("layer.0")


def test_blocks_in_any_order_must_cover_each_jacobian(backend):
    store, reader = backend
    rng = np.random.default_rng(0)
    J, x = rng.standard_normal((4, 3, 5)), rng.standard_normal((3, 5))
    specs = {"attn.2": LayerwiseSpec(2, "attn", False, "forward", 2)}
    writer = store.begin(ID["b"], n_rows=4, n_tokens=3, n_cols=5, dtype="float64", row_block=2, layerwise=specs)
    for (r0, r1), (k0, k1) in reversed(list(itertools.product([(0, 2), (2, 4)], [(0, 2), (2, 3)]))):
        writer.write_block("attn.2", r0, r1, k0, k1, J[r0:r1, k0:k1])
    with pytest.raises(StoreError, match=r"Expected a block inside \(4 rows, 3 tokens\) of attn.2 .* Got rows 2:5"):
        writer.write_block("attn.2", 2, 5, 0, 3, np.zeros((3, 3, 5)))
    with pytest.raises(StoreError, match="Expected 'jacobian' or a layerwise target .* Got 'mlp.2'"):
        writer.write_block("mlp.2", 0, 2, 0, 3, J[:2])
    with pytest.raises(StoreError, match="Expected one of output for a layerwise target .* Got 'attn.2' / 'inputs'"):
        writer.write_layerwise("attn.2", "inputs", x)
    writer.write_block("jacobian", 0, 4, 1, 3, J[:, 1:])  # the prompt's own Jacobian by token blocks too
    writer.write_layerwise("attn.2", "output", np.einsum("rtc,tc->r", J, x))
    for name, values in (("embeddings", x), ("output", np.einsum("rtc,tc->r", J, x)), ("token_ids", np.arange(3))):
        writer.write_array(name, values)
    with pytest.raises(StoreError, match="Expected every array of prompt b{16} before commit. Got none for jacobian"):
        writer.commit({"prompt": "text of b", "n_tokens": 3})  # token 0 of the prompt's Jacobian is missing
    assert reader().prompt_ids() == []


def test_layerwise_targets_are_named_by_the_target_grammar(backend):
    store, _ = backend
    for name, spec in (("layer-1", LayerwiseSpec(1, "layer", False)), ("mlp.1", LayerwiseSpec(1, "mlp", True)),
                       ("resid.1", LayerwiseSpec(1, "resid", False))):
        with pytest.raises(StoreError, match=f"Expected a layerwise target named COMPONENT.*Got '{name}'"):
            store.begin(ID["n"], n_rows=4, n_tokens=3, n_cols=5, dtype="float64", row_block=2, layerwise={name: spec})
    with pytest.raises(StoreError, match="Expected full mode for layerwise Jacobians of prompt 9{16}. Got rank 2"):
        store.begin(ID["n"], n_rows=4, n_tokens=3, n_cols=5, dtype="float64", row_block=2, rank=2,
                    layerwise={"mlp.1": LayerwiseSpec(1, "mlp", False)})


def test_low_rank_prompts_hold_triplets_and_no_jacobian(impl, tmp_path):
    store, put_text = _synthetic(impl, tmp_path / "s", keep="rank:3")
    truth = put_text("a young cat plays in the sea")
    with pytest.raises(StoreError, match="Expected triplets for prompt 7{16} .low-rank mode.. Got jacobian rows"):
        store.begin(ID["q"], n_rows=6, n_tokens=2, n_cols=6, dtype="float64", row_block=2, rank=3).write_rows(
            0, 2, np.zeros((2, 2, 6)))
    store.close()
    prompt = impl.open(tmp_path / "s").get(truth.id)
    assert prompt.low_rank and prompt.attrs["rank"] == 3 and prompt.attrs["passes"] == 3
    J = truth.jacobian
    U, S, V = prompt.triplets()
    np.testing.assert_allclose(S, np.linalg.svd(J.reshape(6, -1), compute_uv=False)[:3], rtol=1e-8)
    assert U.shape == (6, 3) and V.shape == (truth.n_tokens, 6, 3)
    Ut, St, Vt = prompt.triplets(-1)
    np.testing.assert_allclose(St, np.linalg.svd(J[:, -1], compute_uv=False)[:3], rtol=1e-8)
    np.testing.assert_allclose(np.abs(np.sum(Ut * np.linalg.svd(J[:, -1])[0][:, :3], axis=0)), 1, atol=1e-6)
    assert Vt.shape == (6, 3) and np.array_equal(prompt.array("token_S")[-1], St)
    with pytest.raises(InvalidArgumentError, match=r"Expected a token index in \[-7, 7\)"):
        prompt.triplets(7)
    with pytest.raises(StoreError, match="stored in low-rank mode .rank:3.: it has no full Jacobian"):
        prompt.jacobian()
    with pytest.raises(StoreError, match="stored in low-rank mode"):
        prompt.operator(0)
    assert all(r.ok for r in impl.open(tmp_path / "s").verify())


def test_full_prompts_have_no_triplets(backend):
    store, reader = backend
    put(store, ID["a"])
    with pytest.raises(StoreError, match="Prompt a{16} holds the full Jacobian, not triplets"):
        reader().get(ID["a"]).triplets()
    writer = store.begin(ID["t"], n_rows=7, n_tokens=3, n_cols=5, dtype="float64", row_block=3)
    with pytest.raises(StoreError, match="Expected jacobian rows for prompt 7{15}0 .full mode.. Got triplets"):
        writer.write_triplets([], None)
    writer.abort()


def test_an_affine_prompt_keeps_its_offset_and_verify_checks_it(impl, tmp_path):
    store, put_text = _synthetic(impl, tmp_path / "s")
    truth = put_text("the whale is a metal", affine=True)
    rng = np.random.default_rng(5)
    J, x = rng.standard_normal((6, 2, 6)), rng.standard_normal((2, 6))
    with store.begin(WRONG, n_rows=6, n_tokens=2, n_cols=6, dtype="float64", row_block=6) as w:
        w.write_rows(0, 6, J)
        for name, values in (("embeddings", x), ("output", np.einsum("rtc,tc->r", J, x) + 1.0),
                             ("token_ids", np.arange(2)), ("bias", np.full(6, 1.5))):  # b is 1, not 1.5
            w.write_array(name, values)
        with pytest.raises(StoreError, match=r"Expected bias of shape \(6,\) for prompt 0a0a0a0a0a0a0a0a. Got \(5,\)"):
            w.write_array("bias", np.ones(5))
        w.commit({"prompt": "text of wrong", "n_tokens": 2, "reconstruction_error": 0.0, "dtype": "float64"})
    store.close()
    reader = impl.open(tmp_path / "s")
    assert np.array_equal(reader.get(truth.id).bias(), truth.bias) and reader.get(truth.id).attrs["affine"]
    results = {r.id: r for r in reader.verify()}
    assert results[truth.id].ok and results[truth.id].reconstruction_error < 1e-14
    assert not results[WRONG].ok and "reconstruction error" in results[WRONG].reason


def test_verify_checks_each_layerwise_target(backend):
    store, reader = backend
    rng = np.random.default_rng(1)
    J, x = rng.standard_normal((4, 3, 5)), rng.standard_normal((3, 5))
    y = np.einsum("rtc,tc->r", J, x)
    specs = {"layer.0": LayerwiseSpec(0, "layer", False), "layer_local.1": LayerwiseSpec(1, "layer", True)}
    with store.begin(LW, n_rows=4, n_tokens=3, n_cols=5, dtype="float64", row_block=2, layerwise=specs) as w:
        w.write_rows(0, 4, J)
        w.write_block("layer.0", 0, 4, 0, 3, J)
        w.write_layerwise("layer.0", "output", y)
        w.write_block("layer_local.1", 0, 4, 0, 3, J)
        w.write_layerwise("layer_local.1", "inputs", 2 * x)  # its output would be 2 y
        w.write_layerwise("layer_local.1", "output", y)
        for name, values in (("embeddings", x), ("output", y), ("token_ids", np.arange(3))):
            w.write_array(name, values)
        w.commit({"prompt": "text of lw", "n_tokens": 3, "reconstruction_error": 0.0, "dtype": "float64"})
    (result,) = [r for r in reader().verify() if r.kind == "prompt"]
    assert not result.ok and result.reason.startswith("layerwise layer_local.1: reconstruction error 1.000e+00 above")


def test_an_ordinary_jacobian_must_reproduce_its_stored_error(impl, tmp_path):
    store, put_text = _synthetic(impl, tmp_path / "s", detach=False)
    truth = put_text("the harp plays")
    rng = np.random.default_rng(2)
    J, x = rng.standard_normal((6, 2, 6)), rng.standard_normal((2, 6))
    with store.begin(LIAR, n_rows=6, n_tokens=2, n_cols=6, dtype="float64", row_block=6) as w:
        w.write_rows(0, 6, J)
        for name, values in (("embeddings", x), ("output", np.einsum("rtc,tc->r", J, x) + 1.0),
                             ("token_ids", np.arange(2))):
            w.write_array(name, values)
        w.commit({"prompt": "text of liar", "n_tokens": 2, "reconstruction_error": 1e-15, "dtype": "float64",
                  "detached": False})
    store.close()
    results = {r.id: r for r in impl.open(tmp_path / "s").verify()}
    stored = impl.open(tmp_path / "s").get(truth.id).attrs["reconstruction_error"]
    assert results[truth.id].ok and stored > 1e-2 and results[truth.id].reconstruction_error == pytest.approx(stored)
    assert not results[LIAR].ok and "differs from the stored 1e-15" in results[LIAR].reason


def test_failure_records_lease_and_staging(impl, tmp_path):
    path = tmp_path / "s"
    with impl.create(path, RUN) as store:
        store.record_failure(F, {"prompt": "too long", "line": 3, "reason": "too many tokens", "stage": "tokenize"})
        reader = impl.open(path)
        assert reader.failures()[F]["line"] == 3 and "failed_at" in reader.failures()[F]
        with pytest.raises(StoreError, match="Got a failed one .line 3.: too many tokens"):
            reader.get(F)
        with pytest.raises(StoreError, match="Expected a store opened for writing"):
            reader.record_failure("0" * 16, {})
        worker = impl.attach(path, store.lease)
        put(worker, F, seed=1)  # a worker's commit clears the record: complete or failed, never both
        assert impl.open(path).failures() == {} and impl.open(path).prompt_ids() == [F]
        pending = store.begin("0" * 15 + "7", n_rows=7, n_tokens=3, n_cols=5, dtype="float64", row_block=3)
        leftovers = impl.open(path).staging_leftovers()
        assert len(leftovers) == 1 and leftovers[0][:17] == f"{7:016x}."
        with pytest.raises(StoreError, match="Expected a store opened for writing"):
            impl.open(path).clear_staging()
        store.clear_staging()
        assert impl.open(path).staging_leftovers() == []
        pending.abort()
        with pytest.raises(StoreError, match="Expected a store opened for writing"):
            impl.open(path).begin("0" * 16, n_rows=1, n_tokens=1, n_cols=1, dtype="float64", row_block=1)
    with pytest.raises(StoreError, match="that run has ended or another took over"):
        put(worker, "1a7e" * 4)  # the run is over: its worker publishes nothing
    with impl.create(path, RUN) as again:  # closing released the writer: a new run may take the store
        assert again.prompt_ids() == [F]


def test_the_factory_store_reads_back_through_the_interface(tmp_path):
    """The synthetic factory itself writes only through the interface; its stores open with every backend."""
    made = make_store(tmp_path / "s", prompts=3, targets=["layer.1"])
    for impl in BACKENDS.values():
        store = impl.open(made.path)
        assert store.prompt_ids() == made.ids and all(r.ok for r in store.verify())
        for pid, truth in made.prompts.items():
            assert np.array_equal(store.get(pid).jacobian(lazy=False), truth.jacobian)
