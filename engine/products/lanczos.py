"""Top singular triplets of a Jacobian operator from products alone (block Lanczos or subspace iteration).

:func:`operator_svd` works on ``G = J J^T`` (d_model x d_model), applied as ``J (J^T Q)`` without forming ``J``, and
checks each triplet's residual against ``tol * sigma_1``. Algorithm and convergence: docs/engine.md, "The matrix-free
operator"."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from detjac.errors import InvalidArgumentError
from detjac.singular import orient as orient_pairs

from .linear_operator import JacobianOperator

METHODS = ("lanczos", "randomized")
WORK_DTYPE = torch.float64  # the small d_model-sized linear algebra always runs in float64


@dataclass(frozen=True)
class OperatorSVD:
    """Top-k singular triplets ``J v_i = sigma_i u_i`` of an operator, with how they were obtained.

    Attributes
    ----------
    U : torch.Tensor
        (d_model, k) left singular vectors.
    S : torch.Tensor
        (k,) singular values, descending.
    V : torch.Tensor
        (n_tokens * d_model, k) right singular vectors (token-major, as ``J``'s columns).
    residuals : torch.Tensor
        (k,) ``||J v_i - sigma_i u_i|| / sigma_1`` (explicit products when ``verified``).
    converged : bool
        Whether every residual reached ``tol``.
    method, iterations, basis
        The method, its iterations and the final basis size (Krylov or subspace dimension).
    matvecs, rmatvecs : int
        Products with ``J`` and ``J^T`` this computation used (columns).
    """

    U: torch.Tensor
    S: torch.Tensor
    V: torch.Tensor
    residuals: torch.Tensor
    converged: bool
    method: str
    iterations: int
    basis: int
    matvecs: int
    rmatvecs: int
    tol: float
    verified: bool

    def __iter__(self) -> Iterator[torch.Tensor]:
        """``U, S, V = operator_svd(op, k)``."""
        return iter((self.U, self.S, self.V))

    @property
    def products(self) -> int:
        return self.matvecs + self.rmatvecs

    def right_blocks(self, n_tokens: int) -> torch.Tensor:
        """(k, n_tokens, d_model): each right singular vector split into its tokens' blocks."""
        return self.V.T.reshape(self.V.shape[1], n_tokens, -1)


@dataclass
class _Ritz:
    values: torch.Tensor  # (k,) Ritz values theta of G, descending
    vectors: torch.Tensor  # (d, k) Ritz vectors u
    residuals: torch.Tensor  # (k,) ||J v - sigma u|| / sigma_1
    coefficients: torch.Tensor  # (m, m) eigenvectors of the projected matrix, descending


def check_k(k: Any, shape: tuple[int, int]) -> int:
    """``k`` as an int in [1, min(shape)] (the rank bound of ``J``), or an :class:`InvalidArgumentError`."""
    bound = min(shape)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= bound:
        raise InvalidArgumentError(
            f"Expected k between 1 and the rank bound min(d_model, n_tokens * d_model) = {bound} of a "
            f"{shape[0]} x {shape[1]} operator. Got {k!r}."
        )
    return k


def default_tol(dtype: torch.dtype) -> float:
    """1e-8 for float64; the square root of machine epsilon for lower precisions (their products are noisier)."""
    return 1e-8 if dtype == torch.float64 else math.sqrt(torch.finfo(dtype).eps)


def operator_svd(op: JacobianOperator, k: int, *, method: str = "lanczos", block: int = 8, oversample: int = 8,
                 tol: float | None = None, max_iters: int | None = None, seed: int = 0, verify: bool = True,
                 orient: torch.Tensor | None = None, progress: bool = False) -> OperatorSVD:
    """The top ``k`` singular triplets of ``op`` from products with ``J`` and ``J^T`` (see the module docstring).

    Parameters
    ----------
    op
        A :class:`~detjac.engine.products.linear_operator.JacobianOperator` (d_model x n_tokens * d_model).
    k
        Triplets wanted, 1 <= k <= d_model.
    method
        ``"lanczos"`` (block Lanczos) or ``"randomized"`` (subspace iteration).
    block
        Lanczos block: vectors added to the basis per iteration.
    oversample
        Extra vectors of the randomized method's subspace (``k + oversample`` in all).
    tol
        Residual ``||J v - sigma u||`` relative to ``sigma_1`` at which a triplet has converged
        (default :func:`default_tol`).
    max_iters
        Iteration limit (default: none for Lanczos, which ends when its basis spans
        R^d_model at the latest; 100 for the randomized method).
    seed
        Seed of the random start.
    verify
        Recompute the residuals from ``k`` explicit products ``J v`` at the end.
    orient
        (d_model,) flip each pair so that ``u . orient >= 0`` (e.g. ``op.produced``).
    progress
        A progress bar over iterations.

    Returns
    -------
    OperatorSVD
        ``U`` (d_model, k), ``S`` (k,), ``V`` (n_tokens * d_model, k), residuals, products used.

    Raises
    ------
    InvalidArgumentError
        ``k`` outside [1, d_model], an unknown method, or a non-positive block, tol or max_iters.
    """
    k = check_k(k, op.shape)
    _check_options(method, block, oversample, tol, max_iters)
    tol = default_tol(op.dtype) if tol is None else float(tol)
    before = (op.stats.matvecs, op.stats.rmatvecs)
    gen = torch.Generator().manual_seed(seed)
    bar = _bar(progress, method)
    try:
        iterate = _lanczos if method == "lanczos" else _randomized
        ritz, iterations, basis = iterate(op, k, block if method == "lanczos" else k + oversample, tol,
                                          max_iters, gen, bar)
    finally:
        if bar is not None:
            bar.close()
    U = ritz.vectors.to(op.dtype)
    JtU = op.rmatvec(U)  # (N, k)
    S = torch.linalg.vector_norm(JtU.to(WORK_DTYPE), dim=0)  # Rayleigh quotients ||J^T u||
    S_safe = torch.where(S > 0, S, torch.ones_like(S))
    V = (JtU.to(WORK_DTYPE) / S_safe).to(op.dtype)
    residuals = ritz.residuals
    if verify:
        JV = op.matvec(V).to(WORK_DTYPE)
        residuals = torch.linalg.vector_norm(JV - U.to(WORK_DTYPE) * S, dim=0) / S.max()
    order = torch.argsort(S, descending=True)  # Rayleigh quotients may swap two nearly equal Ritz values
    U, S, V, residuals = U[:, order], S[order], V[:, order], residuals[order]
    if orient is not None:
        U, V = orient_pairs(U, V, orient)
    return OperatorSVD(U=U, S=S.to(op.dtype), V=V, residuals=residuals, converged=bool(residuals.max() <= tol),
                       method=method, iterations=iterations, basis=basis,
                       matvecs=op.stats.matvecs - before[0], rmatvecs=op.stats.rmatvecs - before[1],
                       tol=tol, verified=verify)


def _check_options(method: str, block: int, oversample: int, tol: float | None, max_iters: int | None) -> None:
    if method not in METHODS:
        raise InvalidArgumentError(f"Expected method one of {', '.join(METHODS)}. Got {method!r}.")
    for name, value, low in (("block", block, 1), ("oversample", oversample, 0), ("max_iters", max_iters, 1)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise InvalidArgumentError(f"Expected {name} to be an integer >= {low}. Got {value!r}.")
    if tol is not None and not (isinstance(tol, (int, float)) and 0 < tol < 1):
        raise InvalidArgumentError(f"Expected tol in (0, 1), relative to the largest singular value. Got {tol!r}.")


def _gram(op: JacobianOperator, Q: torch.Tensor) -> torch.Tensor:
    """``G Q = J J^T Q`` in the work dtype."""
    return op.gram(Q.to(op.dtype)).to(WORK_DTYPE)


def _rayleigh_ritz(Q: torch.Tensor, Z: torch.Tensor, k: int) -> _Ritz:
    """Ritz pairs of G on span(Q) (orthonormal, d x m) from its images Z = G Q."""
    T = Q.T @ Z
    theta, Y = torch.linalg.eigh((T + T.T) / 2)
    theta, Y = theta.flip(0), Y.flip(1)  # descending
    kk = min(k, Q.shape[1])
    u = Q @ Y[:, :kk]
    rho = torch.linalg.vector_norm(Z @ Y[:, :kk] - u * theta[:kk], dim=0)  # ||G u - theta u||
    sigma = theta[:kk].clamp(min=0).sqrt()
    sigma1 = sigma[0] if sigma[0] > 0 else torch.ones((), dtype=WORK_DTYPE)
    floor = sigma1 * math.sqrt(torch.finfo(WORK_DTYPE).eps)  # null directions: no division by ~0
    residuals = rho / torch.maximum(sigma, floor) / sigma1
    return _Ritz(theta[:kk], u, residuals, Y)


def _orthonormal_extension(basis: torch.Tensor, W: torch.Tensor, width: int, gen: torch.Generator) -> torch.Tensor:
    """``width`` orthonormal vectors spanning W's part outside span(basis); random directions replace the lost ones.

    A column of W that (nearly) lies in span(basis) and the other columns means an invariant
    subspace was found; the Krylov space is then continued from random vectors, so the basis
    keeps growing until it spans the whole space.
    """
    d = basis.shape[0]
    W = W[:, :width]
    scale = torch.linalg.vector_norm(W, dim=0).max().clamp(min=torch.finfo(WORK_DTYPE).tiny)
    for _ in range(4):
        Q, R = torch.linalg.qr(_project_out(basis, W))
        weak = R.diagonal().abs() <= 1e-10 * scale
        if not bool(weak.any()):
            return torch.linalg.qr(_project_out(basis, Q))[0]  # once more: orthogonal to the basis to rounding
        W = torch.where(weak[None, :], torch.randn(d, width, generator=gen, dtype=WORK_DTYPE), Q)
        scale = torch.ones((), dtype=WORK_DTYPE)
    raise AssertionError("Expected random directions outside a basis smaller than the space.")


def _project_out(basis: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """W less its components in span(basis), twice (classical Gram-Schmidt with reorthogonalization)."""
    for _ in range(2):
        W = W - basis @ (basis.T @ W)
    return W


def _lanczos(op: JacobianOperator, k: int, block: int, tol: float, max_iters: int | None,
             gen: torch.Generator, bar: Any) -> tuple[_Ritz, int, int]:
    d = op.shape[0]
    empty = torch.empty(d, 0, dtype=WORK_DTYPE)
    Q = _orthonormal_extension(empty, torch.randn(d, min(block, d), generator=gen, dtype=WORK_DTYPE),
                               min(block, d), gen)
    Z = _gram(op, Q)
    iterations, newest = 1, Q.shape[1]
    while True:
        ritz = _rayleigh_ritz(Q, Z, k)
        _report(bar, ritz, op, Q.shape[1])
        done = Q.shape[1] >= k and bool(ritz.residuals.max() <= tol)
        if done or Q.shape[1] >= d or (max_iters is not None and iterations >= max_iters):
            return ritz, iterations, Q.shape[1]
        new = _orthonormal_extension(Q, Z[:, -newest:], min(block, d - Q.shape[1]), gen)  # the next Krylov block
        Q, Z = torch.cat([Q, new], dim=1), torch.cat([Z, _gram(op, new)], dim=1)
        iterations, newest = iterations + 1, new.shape[1]


def _randomized(op: JacobianOperator, k: int, width: int, tol: float, max_iters: int | None,
                gen: torch.Generator, bar: Any) -> tuple[_Ritz, int, int]:
    d = op.shape[0]
    width = min(width, d)
    limit = 100 if max_iters is None else max_iters
    Q = _orthonormal_extension(torch.empty(d, 0, dtype=WORK_DTYPE),
                               torch.randn(d, width, generator=gen, dtype=WORK_DTYPE), width, gen)
    for iteration in range(1, limit + 1):
        Z = _gram(op, Q)
        ritz = _rayleigh_ritz(Q, Z, k)
        _report(bar, ritz, op, width)
        if bool(ritz.residuals.max() <= tol) or iteration == limit:
            return ritz, iteration, width
        Q = _orthonormal_extension(torch.empty(d, 0, dtype=WORK_DTYPE), Z @ ritz.coefficients, width, gen)
    raise AssertionError("unreachable")


def _bar(progress: bool, method: str) -> Any:
    if not progress:
        return None
    from detjac.progress import tqdm

    return tqdm(desc=f"{method} iterations", unit="it")


def _report(bar: Any, ritz: _Ritz, op: JacobianOperator, basis: int) -> None:
    if bar is not None:
        bar.update()
        bar.set_postfix(residual=f"{float(ritz.residuals.max()):.1e}", basis=basis, products=op.stats.products)
