"""Singular triplets, decoded tokens and dimensionality of stored Jacobians, with dask.

Reads prompts through the store API (``detjac.store``); never imports torch. The combined
operator ``[J_1 ... J_n]`` is the stored ``jacobian`` (row, token, col) viewed as
(row, token * col); it is never loaded whole: dask works chunk by chunk, so it runs past
RAM and on a dask.distributed cluster when a client is active.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidArgumentError
from ..singular import decode_top, orient
from ..targets import Target

if TYPE_CHECKING:
    from ..store import StoredPrompt


@dataclass(frozen=True)
class Spectrum:
    """Top-k triplets of one operator of one prompt, signs fixed so ``u . (J x) >= 0``."""

    prompt_id: str
    token: int | None  # None: the combined operator
    U: np.ndarray  # (rows, k)
    S: np.ndarray  # (k,)
    V: np.ndarray  # (cols, k) per token; (n_tokens, cols, k) combined
    method: str
    params: dict[str, Any] = field(default_factory=dict)
    target: str | None = None  # a layerwise target (``layer.3``, ``mlp_local.0``, ...); None: the model output


def _jacobian(prompt: StoredPrompt, target: str | None) -> Any:
    """The stored (rows, token, cols) Jacobian of the model output or of a layerwise target, lazily."""
    return prompt.jacobian(lazy=True) if target is None else prompt.layerwise(target)


def operator_inputs(prompt: StoredPrompt, target: str | None) -> np.ndarray:
    """What the Jacobian multiplies (token, cols): the input embeddings, a ``*_local`` target's layer inputs or a
    ``to_output`` target's layer outputs."""
    source = Target.parse(target).source_array if target is not None else None
    return prompt.layerwise(target, source) if source is not None else prompt.array("embeddings")


def _output(prompt: StoredPrompt, target: str | None) -> np.ndarray:
    """What the Jacobian reconstructs (rows,)."""
    return prompt.array("output") if target is None else prompt.layerwise(target, "output")


IN_MEMORY = 1 << 22  # entries (32 MB in float64): an operator this small is decomposed in memory, not through dask


def thin_svd(A: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.linalg.svd(A, full_matrices=False)``, retried on ``A.T`` when LAPACK's divide and conquer does
    not converge (it fails on rare finite matrices; the transpose takes another path)."""
    try:
        return np.linalg.svd(A, full_matrices=False)
    except np.linalg.LinAlgError:
        V, S, Ut = np.linalg.svd(A.T, full_matrices=False)
        return Ut.T, S, V.T


def all_singular_values(A: np.ndarray) -> np.ndarray:
    """Every singular value of ``A`` (no vectors), with :func:`thin_svd`'s retry on ``A.T``."""
    try:
        return np.linalg.svd(A, compute_uv=False)
    except np.linalg.LinAlgError:
        return np.linalg.svd(A.T, compute_uv=False)


def operator(prompt: StoredPrompt, token: int | None, target: str | None = None) -> Any:
    """Lazy dask array of ``J_k`` (rows, cols) or, for ``token=None``, ``[J_1 ... J_n]`` (rows, n * cols).

    ``target`` selects a stored layerwise Jacobian instead of the model output's.
    """
    J = _jacobian(prompt, target)  # (rows, n, cols)
    if token is None:
        return J.reshape(J.shape[0], J.shape[1] * J.shape[2])
    n = J.shape[1]
    if not -n <= token < n:
        raise InvalidArgumentError(f"Expected a token index in [-{n}, {n}) for prompt {prompt.id}. Got {token}.")
    return J[:, token % n, :]


def stored_svd(prompt: StoredPrompt, k: int = 8, token: int | None = None, *, method: str = "randomized",
                 power_iterations: int = 4, oversample: int = 10, seed: int = 0, target: str | None = None) -> Spectrum:
    """Top-``k`` singular triplets of a stored prompt's combined operator or of token ``token``'s ``J_k``
    (of the model output, or of the layerwise ``target``).

    ``method="randomized"`` uses ``dask.array.linalg.svd_compressed`` (``power_iterations``
    and ``oversample`` as given); ``"gram"`` the eigendecomposition of the (rows x rows) Gram
    matrix ``A A^T``, accumulated chunk by chunk in one pass (exact top-k for short, wide
    operators such as ``[J_1 ... J_n]``; small singular values lose relative accuracy as
    ``eps * (sigma_1 / sigma_i)^2``); ``"exact"`` a full SVD (the operator must fit in memory).
    An operator of :data:`IN_MEMORY` entries or fewer (a ``d x d`` token operator, a short prompt's combined one)
    is decomposed exactly whatever the method: quicker there than a dask graph, and exact; the spectrum says
    ``"exact"``.
    """
    import dask.array as da

    if k < 1:
        raise InvalidArgumentError(f"Expected k >= 1. Got {k}.")
    if getattr(prompt, "low_rank", False) and target is None:
        return low_rank_spectrum(prompt, k, token)
    A = operator(prompt, token, target).astype(np.float64)
    k = min(k, *A.shape)
    if method not in ("randomized", "gram", "exact"):
        raise InvalidArgumentError(f"Expected method 'randomized', 'gram' or 'exact'. Got {method!r}.")
    if A.size <= IN_MEMORY:
        method = "exact"
    if method == "randomized":
        u, s, vt = da.linalg.svd_compressed(A, k, n_power_iter=power_iterations, n_oversamples=oversample,
                                            seed=seed, compute=True)
        U, S, Vt = da.compute(u, s, vt)
    elif method == "gram":
        U, S = _gram_triplets(A, k)
        Vt = (np.asarray((A.T @ U).compute()) / np.where(S > 0, S, 1.0)).T
    else:
        U, S, Vt = thin_svd(np.asarray(A.compute()))
        U, S, Vt = U[:, :k], S[:k], Vt[:k]
    produced = _produced(prompt, token, target)
    U, V = orient(U, Vt.T, produced)
    if token is None:
        V = V.reshape(prompt.n_tokens, -1, k)
    params = {"k": k, "power_iterations": power_iterations, "oversample": oversample, "seed": seed}
    return Spectrum(prompt.id, token, U, S, V, method, params if method == "randomized" else {"k": k}, target)


def low_rank_spectrum(prompt: StoredPrompt, k: int, token: int | None) -> Spectrum:
    """The top ``k`` of a low-rank prompt's stored triplets (``detjac run --keep rank:K``: computed when the prompt
    was run, the full Jacobian never stored); InvalidArgumentError when ``k`` exceeds the stored rank."""
    U, S, V = prompt.triplets(token)
    rank = int(S.shape[0])
    if k > rank:
        raise InvalidArgumentError(
            f"Expected k <= {rank}: prompt {prompt.id} keeps its top {rank} singular triplets (--keep "
            f"rank:{prompt.attrs.get('rank', rank)}). Got k={k}. Use --k {rank} or less, or run the prompt again "
            "without --keep (the full Jacobian) for more.")
    return Spectrum(prompt.id, token, U[:, :k], S[:k], V[..., :k], "stored triplets", {"k": k})


def _gram_triplets(A: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k left singular vectors and values of a dask array from its streamed Gram matrix."""
    return gram_top(np.asarray((A @ A.T).compute()), k)


def gram_top(gram: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k left singular vectors (rows, k) and values (k,) of ``A`` from its Gram matrix ``A A^T`` (rows, rows)."""
    w, Q = np.linalg.eigh(gram)
    order = np.argsort(w)[::-1][:k]
    return Q[:, order], np.sqrt(np.clip(w[order], 0.0, None))


def gram_left_spectrum(gram: np.ndarray, toward: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every singular value (descending) of a wide ``A`` (rows, m) and its ``u_1`` signed so that ``u_1 . toward >=
    0``, from its Gram matrix ``A A^T`` (rows, rows) in float64: much cheaper than an SVD of ``A`` when m is large,
    and exact to float64 rounding of ``sigma_1^2``."""
    gram = np.asarray(gram, dtype=np.float64)
    U, S = gram_top(gram, gram.shape[0])
    return S, orient(U[:, :1], U[:, :1], np.asarray(toward, dtype=np.float64).reshape(-1))[0][:, 0]


def gram_spectrum(A: Any, k: int) -> np.ndarray:
    """Top-k singular values of a (short, wide) dask array in one streamed pass."""
    return _gram_triplets(A, k)[1]


def _produced(prompt: StoredPrompt, token: int | None, target: str | None = None) -> np.ndarray:
    """What the operator produced: ``sum_k J_k x_k`` for the combined operator (the output less an affine
    model's offset ``b``; layerwise targets come from the streamed engine, which has no offset), ``J_k x_k``
    for a token."""
    if token is None:
        output = _output(prompt, target).astype(np.float64)
        bias = prompt.bias() if target is None else None
        return output - bias.astype(np.float64) if bias is not None else output
    x = operator_inputs(prompt, target)[token].astype(np.float64)
    return np.asarray(operator(prompt, token, target).astype(np.float64) @ x)


def decode(vectors: np.ndarray, matrix: np.ndarray, top: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Top token ids and scores of each column of ``vectors`` (d, k) through ``matrix`` (vocab, d): (k, top) each,
    scored in float64 (:func:`detjac.singular.decode_top`)."""
    return decode_top(np.asarray(vectors, dtype=np.float64), np.asarray(matrix, dtype=np.float64), top)


def singular_values(prompt: StoredPrompt, token: int | None = None, target: str | None = None) -> np.ndarray:
    """All singular values (exact): by LAPACK for an operator of :data:`IN_MEMORY` entries or fewer, else by a
    tall-and-skinny dask SVD of its transpose.

    Raises
    ------
    InvalidArgumentError
        For a low-rank prompt: it keeps only the top singular values, and every one is needed (stable rank,
        energy ranks).
    """
    import dask.array as da

    if getattr(prompt, "low_rank", False):
        raise InvalidArgumentError(
            f"Expected a prompt with its full Jacobian: this needs every singular value (stable rank, energy ranks, "
            f"the spectrum). Got prompt {prompt.id}, stored in low-rank mode (--keep {prompt.attrs.get('keep')}: its "
            "top singular triplets only; `detjac analyze svd` and `decode` read them). Run the prompts again "
            "without --keep (`detjac run MODEL PROMPTS --out FULL.zarr`) for this.")
    A = operator(prompt, token, target).astype(np.float64)
    if A.size <= IN_MEMORY:  # LAPACK on the whole matrix: a dask graph costs more than the SVD here
        return all_singular_values(np.asarray(A.compute()))
    tall = A.T.rechunk({0: "auto", 1: -1})  # (cols, rows): one chunk across the short side
    _, s, _ = da.linalg.svd(tall)
    return np.asarray(s.compute())


@dataclass(frozen=True)
class Dimensionality:
    stable_rank: float  # ||A||_F^2 / sigma_1^2
    participation_ratio: float  # (sum sigma^2)^2 / sum sigma^4
    n90: int  # singular values holding 90 % of the energy
    n99: int


def dimensionality(s: np.ndarray) -> Dimensionality:
    """Effective dimensionality of an operator from its singular values."""
    energy = np.asarray(s, dtype=np.float64) ** 2
    total = energy.sum()
    if total <= 0:
        return Dimensionality(0.0, 0.0, 0, 0)
    cumulative = np.cumsum(np.sort(energy)[::-1]) / total
    return Dimensionality(float(total / energy.max()), float(total**2 / (energy**2).sum()),
                          int(np.searchsorted(cumulative, 0.9) + 1), int(np.searchsorted(cumulative, 0.99) + 1))
