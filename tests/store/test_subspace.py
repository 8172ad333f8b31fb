"""Low-rank mode: subspace iteration over streamed rows against numpy's exact SVD (`detjac run --keep rank:K` is
in tests/runs/test_low_rank_run.py, low-rank prompts in a store in test_store_conformance.py)."""

from __future__ import annotations

import numpy as np
import pytest

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
