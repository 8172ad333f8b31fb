"""dask analyses of a store: SVD against numpy, decoding a planted direction, schedulers agree.

The stores are synthetic (``detjac.store.testing``): wide enough (d = 32) that a randomized SVD of
rank 6 with 10 oversamples is not trivially exact; `detjac run --ordinary` then compare is in
tests/runs/test_ordinary_run.py.
"""

from __future__ import annotations

import subprocess
import sys

import dask
import numpy as np
import pytest
from click.testing import CliRunner

from detjac.analysis import jobs
from detjac.analysis.spectra import dimensionality, singular_values, stored_svd
from detjac.cli.main import main
from detjac.store import create_store, open_store
from detjac.store.testing import make_store, prompt_texts, synthetic_model

MODEL = synthetic_model(d_model=32, vocab=60, seed=11)
TEXTS = prompt_texts(2, 5, seed=11)


P = "0" * 16  # a prompt id (16 hex digits)


@pytest.fixture(scope="module")
def real_store(tmp_path_factory):
    """Two prompts of five tokens, d = 32 (the name is the one the tests had with a store of the default model)."""
    return make_store(tmp_path_factory.mktemp("analysis") / "s.zarr", prompts=TEXTS, model=MODEL).open()


def test_randomized_svd_matches_numpy(real_store):
    for prompt in real_store:
        J = prompt.jacobian(lazy=False).astype(np.float64)
        for token, A in ((None, J.reshape(J.shape[0], -1)), (-1, J[:, -1, :])):
            exact = np.linalg.svd(A, compute_uv=False)
            spec = stored_svd(prompt, 6, token, power_iterations=6)
            np.testing.assert_allclose(spec.S, exact[:6], rtol=1e-6)
            np.testing.assert_allclose(stored_svd(prompt, 6, token, method="exact").S, exact[:6], rtol=1e-12)
            gram = stored_svd(prompt, 6, token, method="gram")
            np.testing.assert_allclose(gram.S, exact[:6], rtol=1e-10)
            V = gram.V.reshape(-1, 6)
            np.testing.assert_allclose(gram.U @ np.diag(gram.S) @ V.T, (A @ V) @ V.T, atol=1e-9 * exact[0])
            np.testing.assert_allclose(singular_values(prompt, token), exact, rtol=1e-10, atol=1e-12 * exact[0])
            assert np.all(spec.U.T @ (A @ prompt.array("embeddings")[-1] if token is not None
                                      else prompt.array("output")) >= 0)


def test_results_are_written_back_and_reused(real_store):
    pid = real_store.prompt_ids()[0]
    first = jobs.prompt_svds(real_store, [pid], k=3)[0]
    arrays, attrs = real_store.read_analysis(pid, "svd_combined")
    assert np.array_equal(arrays["S"], first.S) and attrs["params"]["power_iterations"] == 6
    again = jobs.prompt_svds(real_store, [pid], k=3)
    assert real_store.read_analysis(pid, "svd_combined")[1]["written_at"] == attrs["written_at"]
    assert np.array_equal(again[0].S, first.S)
    jobs.prompt_svds(real_store, [pid], k=4)  # other parameters: recomputed and replaced
    assert real_store.read_analysis(pid, "svd_combined")[0]["S"].shape == (4,)


def test_decoding_returns_a_planted_direction(tmp_path):
    rng = np.random.default_rng(0)
    vocab, d, n = 60, 16, 4
    embed, unembed = rng.standard_normal((vocab, d)), rng.standard_normal((vocab, d))
    out_token, in_token, position = 17, 42, 2
    u, v = unembed[out_token] / np.linalg.norm(unembed[out_token]), embed[in_token] / np.linalg.norm(embed[in_token])
    J = 1e-3 * rng.standard_normal((d, n, d))
    J[:, position, :] += 5.0 * np.outer(u, v)
    x = rng.standard_normal((n, d))
    x[position] = v
    run = {"model_id": "planted", "dtype": "float64", "keep": "full"}
    model_data = lambda: ({"embedding": embed, "unembedding": unembed}, {})  # noqa: E731
    with create_store(tmp_path / "s.zarr", run, model_data=model_data) as st:
        with st.begin(P, n_rows=d, n_tokens=n, n_cols=d, dtype="float64", row_block=4) as w:
            for start in range(0, d, 4):
                w.write_rows(start, start + 4, J[start:start + 4])
            w.write_array("embeddings", x)
            w.write_array("output", np.einsum("rtc,tc->r", J, x))
            w.write_array("token_ids", np.arange(n))
            w.commit({"prompt": "planted", "n_tokens": n, "reconstruction_error": 0.0, "dtype": "float64"})
    store = open_store(tmp_path / "s.zarr")
    decoded = jobs.decode_spectrum(store, jobs.prompt_svds(store, [P], k=2)[0], top=3)
    assert decoded.left_ids[0, 0] == out_token and decoded.right_ids[0, 0] == in_token
    assert decoded.right_tokens[0] == position and decoded.right_shares[0] > 0.99
    assert decoded["left_ids"] is decoded.left_ids  # the former dict's keys still read (view/)


def test_one_decoder_reads_the_matrices_once_for_every_prompt(real_store, monkeypatch):
    from detjac.analysis.decoded import decode_spectra

    store = open_store(real_store.path)
    spectra = jobs.prompt_svds(store, store.prompt_ids(), k=2)
    reads: list[str] = []
    model_array = type(store).model_array
    monkeypatch.setattr(type(store), "model_array", lambda self, name: reads.append(name) or model_array(self, name))
    decoded = decode_spectra(store, spectra, top=3)
    assert len(spectra) == 2 and sorted(reads) == ["embedding", "unembedding"]
    text = jobs.piece_reader(store)
    for spec, got in zip(spectra, decoded, strict=True):  # the same tokens as a decoder of its own per prompt
        alone = jobs.decode_spectrum(store, spec, 3)
        assert [t.right_token for t in got.triplets] == alone.right_tokens
        assert [t.left for t in got.triplets] == [" ".join(text(i) for i in row) for row in alone.left_ids]


@pytest.mark.slow
def test_local_cluster_gives_the_same_answers(real_store):
    from distributed import Client, LocalCluster

    pid = real_store.prompt_ids()[1]
    with dask.config.set(scheduler="synchronous"):
        single = stored_svd(real_store.get(pid), 4, power_iterations=4)
        single_dims = dimensionality(singular_values(real_store.get(pid)))
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster):
        multi = stored_svd(real_store.get(pid), 4, power_iterations=4)
        multi_dims = dimensionality(singular_values(real_store.get(pid)))
    np.testing.assert_allclose(multi.S, single.S, rtol=1e-12)
    np.testing.assert_allclose(np.abs(multi.U.T @ single.U), np.eye(4), atol=1e-8)
    assert multi_dims.n90 == single_dims.n90 and multi_dims.stable_rank == pytest.approx(single_dims.stable_rank)


def test_dimensionality_of_known_spectra():
    flat = dimensionality(np.ones(4))
    assert (flat.stable_rank, flat.participation_ratio, flat.n90, flat.n99) == (4.0, 4.0, 4, 4)
    spike = dimensionality(np.array([1.0, 0.0, 0.0]))
    assert (spike.stable_rank, spike.participation_ratio, spike.n90, spike.n99) == (1.0, 1.0, 1, 1)
    assert dimensionality(np.array([3.0, 1.0])).n90 == 1 and dimensionality(np.array([3.0, 1.0])).n99 == 2


@pytest.mark.slow  # ~20 s: dask's ProgressBar in the CLI waits up to 0.5 s after each of ~30 computes
def test_analyze_commands(real_store, tmp_path):
    path = str(real_store.path)
    svd = CliRunner().invoke(main, ["analyze", "svd", path, "--k", "2", "--top", "4"])
    assert svd.exit_code == 0, svd.output
    assert len([line for line in svd.output.splitlines() if line.strip().startswith("#")]) == 4
    dims = CliRunner().invoke(main, ["analyze", "dims", path, "--csv", str(tmp_path / "d.csv")])
    assert dims.exit_code == 0, dims.output
    rows = (tmp_path / "d.csv").read_text().splitlines()
    assert rows[0].startswith("prompt_id,token,stable_rank") and len(rows) == 1 + sum(1 + p.n_tokens
                                                                                       for p in real_store)


def test_analysis_does_not_import_torch():
    """Every analysis module, and the store, import neither torch nor the engine (nor does a whole analysis)."""
    code = ("import sys, pkgutil, importlib, detjac.analysis, detjac.store\n"
            "for pkg in (detjac.analysis, detjac.store):\n"
            "    for m in pkgutil.iter_modules(pkg.__path__):\n"
            "        importlib.import_module(f'{pkg.__name__}.{m.name}')\n"
            "print(sorted(m for m in sys.modules if m.partition('.')[0] in ('torch', 'transformers') "
            "or m.startswith('detjac.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_detached_against_ordinary(real_store, tmp_path):
    ordinary = make_store(tmp_path / "ord.zarr", prompts=TEXTS, model=MODEL, detach=False).path
    plot = tmp_path / "c.png"
    out = CliRunner().invoke(main, ["analyze", "compare", str(real_store.path), str(ordinary), "--plot", str(plot),
                                    "--csv", str(tmp_path / "c.csv")])
    assert out.exit_code == 0, out.output
    assert "prediction among the top-10 decoded tokens of u_1: detached" in out.output
    assert plot.read_bytes()[:4] == b"\x89PNG" and len((tmp_path / "c.csv").read_text().splitlines()) == 3
    swapped = CliRunner().invoke(main, ["analyze", "compare", str(ordinary), str(real_store.path)])
    assert swapped.exit_code == 1 and "Expected a detached store first" in swapped.output
    from detjac.analysis.compare import compare

    rows = compare(real_store, open_store(ordinary))
    assert [r["prompt"] for r in rows] == [p.prompt for p in real_store]
    for r, prompt in zip(rows, real_store, strict=True):
        J = prompt.jacobian(lazy=False)
        s = np.linalg.svd(J.reshape(J.shape[0], -1), compute_uv=False)
        np.testing.assert_allclose(r["detached_spectrum"], s, rtol=1e-10)
        assert r["detached_error"] < 1e-14 < 1e-2 < r["ordinary_error"]
        assert r["detached_stable_rank"] == pytest.approx((s**2).sum() / s[0] ** 2)


def test_compare_refuses_stores_of_two_models_naming_both(real_store, tmp_path):
    other = make_store(tmp_path / "other.zarr", prompts=TEXTS, d_model=MODEL.d_model, seed=5, detach=False).path
    out = CliRunner().invoke(main, ["analyze", "compare", str(real_store.path), str(other)])
    assert out.exit_code == 1
    assert "Expected two stores of the same model." in out.output
    assert "(s.zarr) != " in out.output and "(other.zarr)" in out.output and "weights_sha256" in out.output
    assert not (tmp_path / "detjac-compare.png").exists()


def test_report_writes_tables_and_figures(real_store, tmp_path):
    import json

    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["analyze", "report", str(real_store.path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prompts"] == 2 and 0 <= summary["prediction_in_u1_top"] <= 1
    for name in ("spectra.png", "dims_by_position.png", "decoded.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name
    decoded = (out / "decoded.csv").read_text().splitlines()
    assert decoded[0].startswith("prompt_id,prompt,next_token,u1_tokens,u1_hit") and len(decoded) == 3
    assert real_store.read_analysis(real_store.prompt_ids()[0], "svd_combined")[1]["params"]["method"] == "gram"
