"""What `detjac store info|verify|export` report (store/summary.py), on small stores written here."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from detjac.errors import StoreError
from detjac.store import create_store, open_store
from detjac.store.subspace import Triplets
from detjac.store.summary import export_npz, prompt_layout, store_summary, verify_summary

RUN = {"model_id": "m", "model_type": "llama", "config_sha256": "c", "revision": None, "dtype": "float64",
       "keep": "full", "detach": True, "position": -1, "target": "hidden", "row_block": 2}
ROWS, N, COLS = 4, 3, 5


GOOD, BAD, LOST, LOW = "900d" * 4, "bad0" * 4, "1057" * 4, "10" * 8  # prompt ids are 16 hex digits


def _write_full(store, pid, scale=1.0, seed=0):
    """A prompt whose stored output is ``scale`` times ``sum_k J_k x_k``."""
    rng = np.random.default_rng(seed)
    J, x = rng.standard_normal((ROWS, N, COLS)), rng.standard_normal((N, COLS))
    with store.begin(pid, n_rows=ROWS, n_tokens=N, n_cols=COLS, dtype="float64", row_block=2) as w:
        w.write_rows(0, ROWS, J)
        w.write_array("embeddings", x)
        w.write_array("output", scale * np.einsum("rtc,tc->r", J, x))
        w.write_array("token_ids", np.arange(N))
        w.commit({"prompt": f"text of {pid}", "n_tokens": N, "reconstruction_error": 0.0, "dtype": "float64"})
    return J, x


@pytest.fixture
def full_store(tmp_path):
    path = tmp_path / "s.zarr"
    with create_store(path, RUN) as st:
        _write_full(st, GOOD, 1 + 1e-12)
        _write_full(st, BAD, 2.0, seed=1)
        st.record_failure(LOST, {"prompt": "too long", "line": 3, "reason": "Expected fewer tokens.",
                                   "error": "PromptError", "stage": "tokenize"})
    return path


def test_store_summary_counts_prompts_bytes_leftovers_and_failures(full_store):
    (full_store / "_staging" / "half.host.1.x").mkdir(parents=True)
    summary = store_summary(open_store(full_store))
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(full_store) for f in files)
    assert summary.complete == 2 and summary.disk_bytes == on_disk > 0
    assert summary.run["model_id"] == "m" and summary.format_version == open_store(full_store).format_version
    assert summary.created == open_store(full_store).created is not None
    assert summary.staging_leftovers == ["half.host.1.x"]
    assert list(summary.failures) == [LOST] and summary.failures[LOST]["line"] == 3 and summary.damaged == {}


def test_verify_summary_names_the_corrupt_prompt_and_the_worst_error_of_the_others(full_store):
    result = verify_summary(open_store(full_store))
    assert [r.id for r in result.corrupt] == [BAD] and result.ok == 1 and result.prompts == 2
    assert [(r.kind, r.id, r.ok) for r in result.results[2:]] == [("failed", f"failed/{LOST}", True)]
    assert result.corrupt[0].reason.startswith("reconstruction error 5.000e-01 above")
    assert result.worst_error == pytest.approx(1e-12, rel=1e-3)  # |y/(1+e) - y| / |y|, the good prompt's


def test_layout_and_export_of_a_full_prompt(full_store, tmp_path):
    store = open_store(full_store)
    layout = prompt_layout(store.get(GOOD))
    assert not layout.low_rank and layout.shape == (ROWS, N, COLS) and layout.dtype == "float64"
    assert layout.chunks[0] == 2 and layout.n_tokens == N and layout.attrs["prompt"] == f"text of {GOOD}"
    out = export_npz(store, GOOD, tmp_path / "good.npz")
    data = np.load(out)
    assert sorted(data.files) == ["attrs", "embeddings", "jacobian", "output", "token_ids"]
    np.testing.assert_array_equal(data["jacobian"], store.get(GOOD).jacobian(lazy=False))
    np.testing.assert_array_equal(data["embeddings"], store.get(GOOD).array("embeddings"))
    assert json.loads(str(data["attrs"])) == store.get(GOOD).attrs
    with pytest.raises(StoreError, match="Got a failed one"):
        export_npz(store, LOST, tmp_path / "lost.npz")


def test_layout_and_export_of_a_low_rank_prompt(tmp_path):
    rng = np.random.default_rng(0)
    rank = 2

    def triplets(cols):
        return Triplets(rng.standard_normal((ROWS, rank)), np.array([3.0, 1.0]), rng.standard_normal((cols, rank)),
                        12.0, 2.0)

    path = tmp_path / "lr.zarr"
    with create_store(path, {**RUN, "keep": f"rank:{rank}"}) as st, \
            st.begin(LOW, n_rows=ROWS, n_tokens=N, n_cols=COLS, dtype="float64", row_block=2, rank=rank) as w:
        attrs = w.write_triplets([triplets(COLS) for _ in range(N)], triplets(N * COLS))
        for name, values in (("embeddings", np.ones((N, COLS))), ("output", np.ones(ROWS)),
                             ("token_ids", np.arange(N))):
            w.write_array(name, values)
        w.commit({"prompt": "low rank", "n_tokens": N, "reconstruction_error": 0.1, "dtype": "float64", **attrs})
    store = open_store(path)
    layout = prompt_layout(store.get(LOW))
    assert layout.low_rank and layout.rank == rank and layout.n_tokens == N and layout.shape is None
    assert layout.triplet_shapes == ((ROWS, rank), (rank,), (N, COLS, rank))
    data = np.load(export_npz(store, LOW, tmp_path / "lr.npz"))
    assert {"combined_U", "combined_S", "combined_V", "token_U", "token_S", "token_V", "token_frobenius_sq"} \
        <= set(data.files) and "jacobian" not in data.files
    np.testing.assert_array_equal(data["combined_S"], [3.0, 1.0])
    assert data["token_U"].shape == (N, ROWS, rank)
