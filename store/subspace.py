"""Top-K singular triplets of every ``J_k`` and of ``[J_1 ... J_n]`` from streamed row blocks: a randomized
subspace iteration, one engine run per pass (low-rank mode). The algorithm and its exact error bound:
docs/store-format.md, "Low-rank mode"."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Triplets:
    """``A ~= U diag(S) V^T`` with the exact energies that bound the approximation."""

    U: np.ndarray  # (rows, K)
    S: np.ndarray  # (K,)
    V: np.ndarray  # (cols, K)
    frobenius_sq: float  # ||A||_F^2, exact
    residual_sq: float  # ||A - Q Q^T A||_F^2 for the final subspace Q (>= sum of the discarded sigma^2)

    @property
    def captured(self) -> float:
        """Fraction of ``||A||_F^2`` in the K stored triplets."""
        return float((self.S**2).sum() / self.frobenius_sq) if self.frobenius_sq > 0 else 0.0


def sketch_size(rank: int, n_rows: int, n_cols: int) -> int:
    """Subspace dimension: the rank plus generous oversampling, at most the matrix's smaller side."""
    return min(2 * rank + 32, n_rows, n_cols)


class SubspaceIteration:
    """Accumulates passes over a Jacobian's rows; see the module docstring."""

    def __init__(self, n_rows: int, n_tokens: int, n_cols: int, rank: int, *, passes: int = 3, seed: int = 0):
        if rank < 1 or passes < 1:
            raise ValueError(f"Expected rank >= 1 and passes >= 1. Got rank={rank}, passes={passes}.")
        self.shape, self.rank, self.passes = (n_rows, n_tokens, n_cols), rank, passes
        self.s_tok = sketch_size(rank, n_rows, n_cols)
        self.s_comb = sketch_size(rank, n_rows, n_tokens * n_cols)
        rng = np.random.default_rng(seed)
        self.Z_tok = np.linalg.qr(rng.standard_normal((n_tokens, n_cols, self.s_tok)))[0]  # (n, cols, s)
        self.Z_comb = np.linalg.qr(rng.standard_normal((n_tokens * n_cols, self.s_comb)))[0]  # (n*cols, s)
        self.pass_index = 0
        self._begin_pass()

    def _begin_pass(self) -> None:
        n_rows, n, n_cols = self.shape
        self.next_row = 0
        self.Y_tok, self.M_tok = np.zeros((n, n_rows, self.s_tok)), np.zeros((n, n_cols, self.s_tok))
        self.Y_comb, self.M_comb = np.zeros((n_rows, self.s_comb)), np.zeros((n * n_cols, self.s_comb))
        self.fro_tok = np.zeros(n)

    def update(self, start: int, stop: int, values: np.ndarray) -> None:
        """Rows ``start:stop`` of J, (rows, n_tokens, n_cols), in order within the current pass."""
        n_rows, n, n_cols = self.shape
        if start != self.next_row or values.shape != (stop - start, n, n_cols):
            raise ValueError(f"Expected rows from {self.next_row} of shape (rows, {n}, {n_cols}). "
                             f"Got rows {start}:{stop} of shape {values.shape}.")
        block = np.asarray(values, dtype=np.float64)
        per_token = block.transpose(1, 0, 2)  # (n, rows, cols)
        y = per_token @ self.Z_tok  # (n, rows, s)
        self.Y_tok[:, start:stop] = y
        self.M_tok += per_token.transpose(0, 2, 1) @ y
        flat = block.reshape(stop - start, n * n_cols)
        yc = flat @ self.Z_comb  # (rows, s)
        self.Y_comb[start:stop] = yc
        self.M_comb += flat.T @ yc
        self.fro_tok += np.einsum("rtc,rtc->t", block, block)
        self.next_row = stop

    def end_pass(self) -> bool:
        """Close the pass; True when another pass is needed (then stream the rows again)."""
        if self.next_row != self.shape[0]:
            raise ValueError(f"Expected all {self.shape[0]} rows before the end of a pass. Got {self.next_row}.")
        self.pass_index += 1
        if self.pass_index >= self.passes:
            return False
        self.Z_tok = np.linalg.qr(self.M_tok)[0]
        self.Z_comb = np.linalg.qr(self.M_comb)[0]
        self._begin_pass()
        return True

    def finish(self) -> tuple[list[Triplets], Triplets]:
        """Per-token and combined triplets from the last pass."""
        if self.pass_index < self.passes:
            raise ValueError(f"Expected {self.passes} complete passes. Got {self.pass_index}.")
        n_rows, n, n_cols = self.shape
        per_token = [_project(self.Y_tok[t], self.M_tok[t], self.rank, float(self.fro_tok[t])) for t in range(n)]
        combined = _project(self.Y_comb, self.M_comb, self.rank, float(self.fro_tok.sum()))
        return per_token, combined


def _project(Y: np.ndarray, M: np.ndarray, rank: int, frobenius_sq: float) -> Triplets:
    """From ``Y = A Z`` and ``M = A^T Y``: ``B = Q^T A`` with ``Y = Q T``, then the SVD of B."""
    Q, T = np.linalg.qr(Y)  # (rows, s), (s, s)
    B = np.linalg.lstsq(T.T, M.T, rcond=None)[0]  # solves T^T B = M^T, i.e. B = T^{-T} M^T: (s, cols)
    Ub, S, Vt = np.linalg.svd(B, full_matrices=False)
    K = min(rank, len(S))
    U, V = Q @ Ub[:, :K], Vt[:K].T
    flip = np.where(U[np.abs(U).argmax(0), np.arange(K)] < 0, -1.0, 1.0)  # largest entry of each u positive
    residual = max(frobenius_sq - float((B**2).sum()), 0.0)
    return Triplets(U * flip, S[:K], V * flip, frobenius_sq, residual)
