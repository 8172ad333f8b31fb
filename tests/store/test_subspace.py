"""Low-rank mode: subspace iteration over streamed rows against numpy's exact SVD; `--keep rank:K` runs."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from store_helpers import PROMPTS, write_prompts

from detjac.cli.main import main
from detjac.errors import StoreError
from detjac.store import open_store
from detjac.store.subspace import SubspaceIteration


def run_passes(J: np.ndarray, rank: int, passes: int, block: int = 7):
    rows, n, cols = J.shape
    it = SubspaceIteration(rows, n, cols, rank, passes=passes)
    more = True
    while more:
        for start in range(0, rows, block):
            it.update(start, min(start + block, rows), J[start:start + block])
        more = it.end_pass()
    return it.finish()


def slow_spectrum(seed: int = 0, rows: int = 120, n: int = 3, cols: int = 100) -> np.ndarray:
    """Singular values decaying like 1/(i+1): the hard case for randomized methods."""
    rng = np.random.default_rng(seed)
    J = np.empty((rows, n, cols))
    for t in range(n):
        U = np.linalg.qr(rng.standard_normal((rows, cols)))[0]
        V = np.linalg.qr(rng.standard_normal((cols, cols)))[0]
        J[:, t, :] = (U * (1.0 / np.arange(1, cols + 1))) @ V.T
    return J


def test_three_passes_match_the_exact_svd():
    J = slow_spectrum()
    per_token, combined = run_passes(J, rank=4, passes=3)
    for t, trip in enumerate(per_token):
        U, S, Vt = np.linalg.svd(J[:, t, :])
        np.testing.assert_allclose(trip.S, S[:4], rtol=1e-9)  # measured 2.7e-11
        np.testing.assert_allclose(np.abs(np.sum(trip.U * U[:, :4], axis=0)), 1, atol=1e-9)
        np.testing.assert_allclose(trip.U @ np.diag(trip.S) @ trip.V.T, (U[:, :4] * S[:4]) @ Vt[:4], atol=1e-6)
        assert trip.frobenius_sq == pytest.approx(float((J[:, t, :] ** 2).sum()), rel=1e-12)
    C = J.reshape(J.shape[0], -1)
    S = np.linalg.svd(C, compute_uv=False)
    np.testing.assert_allclose(combined.S, S[:4], rtol=1e-7)  # measured 3.6e-9
    assert combined.frobenius_sq == pytest.approx(float((C**2).sum()), rel=1e-12)
    sketch = SubspaceIteration(120, 3, 100, 4).s_comb
    assert sketch < min(C.shape)  # the test is not trivially exact
    assert combined.residual_sq >= (S[sketch:] ** 2).sum() * (1 - 1e-9)  # no subspace of that size does better


def test_more_passes_are_more_accurate():
    J = slow_spectrum(seed=1)
    exact = np.linalg.svd(J[:, 0, :], compute_uv=False)[:4]
    errors = [np.max(np.abs(run_passes(J, 4, p)[0][0].S - exact) / exact) for p in (1, 2, 3)]
    assert errors[0] > errors[1] > errors[2]


def test_deterministic_and_checked():
    J = slow_spectrum(seed=2)
    a, b = run_passes(J, 3, 2), run_passes(J, 3, 2)
    assert all(np.array_equal(x.U, y.U) and np.array_equal(x.S, y.S) for x, y in zip(a[0], b[0], strict=True))
    it = SubspaceIteration(120, 3, 100, 3)
    with pytest.raises(ValueError, match="Expected rows from 0 of shape"):
        it.update(7, 14, J[7:14])
    it.update(0, 7, J[:7])
    with pytest.raises(ValueError, match="Expected all 120 rows before the end of a pass. Got 7"):
        it.end_pass()
    with pytest.raises(ValueError, match="Expected 3 complete passes. Got 0"):
        it.finish()


def test_low_rank_run_stores_triplets_close_to_the_full_run(tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:2])
    runner = CliRunner()
    for keep, out in (("full", "full.zarr"), ("rank:6", "low.zarr")):
        result = runner.invoke(main, ["run", "default", str(prompts), "--out", str(tmp_path / out), "--keep", keep])
        assert result.exit_code == 0, result.output
    full = {p.prompt: p for p in open_store(tmp_path / "full.zarr")}
    low = open_store(tmp_path / "low.zarr")
    assert low.run["keep"] == "rank:6" and len(low) == 2
    for p in low:
        J = full[p.prompt].jacobian(lazy=False)
        U, S, V = p.triplets()
        exact = np.linalg.svd(J.reshape(J.shape[0], -1), compute_uv=False)[:6]
        np.testing.assert_allclose(S, exact, rtol=1e-5)
        assert V.shape == (p.n_tokens, J.shape[2], 6) and U.shape == (J.shape[0], 6)
        Ut, St, Vt = p.triplets(-1)
        np.testing.assert_allclose(St, np.linalg.svd(J[:, -1, :], compute_uv=False)[:6], rtol=1e-8)
        assert p.attrs["reconstruction_error"] < 1e-12 and 0 < p.attrs["combined_captured"] <= 1
        with pytest.raises(StoreError, match="stored in low-rank mode"):
            p.jacobian()
        assert (tmp_path / "low.zarr" / "prompts" / p.id / "jacobian").exists() is False
    verify = runner.invoke(main, ["store", "verify", str(tmp_path / "low.zarr")])
    assert verify.exit_code == 0 and "2 of 2 prompts ok" in verify.output
    pid = low.prompt_ids()[0]
    info = runner.invoke(main, ["store", "info", str(tmp_path / "low.zarr"), pid])
    assert info.exit_code == 0 and "low rank: combined U (256, 6), S (6,)" in info.output
    assert runner.invoke(main, ["store", "export", str(tmp_path / "low.zarr"), pid, "--out",
                                str(tmp_path / "x.npz")]).exit_code == 0
    data = np.load(tmp_path / "x.npz", allow_pickle=False)
    assert "jacobian" not in data.files and np.array_equal(data["combined_S"], low.get(pid).triplets()[1])


def test_keep_is_validated(tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:1])
    args = ["run", "default", str(prompts), "--out", str(tmp_path / "s"), "--keep", "rank:0"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "Expected --keep full or --keep rank:K" in result.output
    assert not (tmp_path / "s").exists()
