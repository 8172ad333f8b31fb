"""Three views of stored Jacobians that the paper's reference code draws: the largest columns of ``J_k`` decoded
(:func:`largest_columns`), ``J_k`` as an image (:func:`jacobian_image`) and the top singular vectors' path across
depth (:func:`singular_path`). What each shows: docs/user-guide.md, "Three views"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidArgumentError
from ..singular import decode_top, orient
from ..targets import OUTPUT, Target
from .layers import lens, target_spectrum
from .spectra import dimensionality, operator, operator_inputs

if TYPE_CHECKING:
    from ..store import StoredPrompt, StoreReader


def _token_index(prompt: StoredPrompt, token: int) -> int:
    n = prompt.n_tokens
    if not -n <= token < n:
        raise InvalidArgumentError(f"Expected a token index in [-{n}, {n}) for prompt {prompt.id}. Got {token}.")
    return token % n


def _decoder(store: StoreReader, target: str | None) -> np.ndarray:
    """The matrix that decodes the target's rows: ``W_U`` for the output, :func:`lens` for a layerwise target."""
    return store.model_array("unembedding").astype(np.float64) if target is None else lens(store, target)[0]


def largest_columns(store: StoreReader, prompt_id: str, *, target: str | None = None, tokens: list[int] | None = None,
                    count: int = 8, top: int = 6) -> list[dict[str, Any]]:
    """The ``count`` largest-norm columns of ``J_k`` for each of ``tokens`` (default: every token), decoded.

    Parameters
    ----------
    store : StoreReader
    prompt_id : str
    target : str or None
        A stored layerwise target, or None for the model output's Jacobian.
    tokens : list of int or None
        Token indices (negative from the end).
    count : int
        Columns per token.
    top : int
        Decoded tokens per column.

    Returns
    -------
    list of dict
        One row per column: ``prompt_id``, ``target``, ``token`` (index), ``column`` (the input
        dimension), ``norm``, ``decoded`` (token ids, best first) and ``scores``.
    """
    if count < 1 or top < 1:
        raise InvalidArgumentError(f"Expected count >= 1 and top >= 1. Got count={count}, top={top}.")
    prompt = store.get(prompt_id)
    picked = [_token_index(prompt, k) for k in (tokens if tokens is not None else range(prompt.n_tokens))]
    W = _decoder(store, target)
    x = operator_inputs(prompt, target).astype(np.float64)  # (n, cols)
    rows = []
    for k in picked:
        J = np.asarray(operator(prompt, k, target).compute(), dtype=np.float64)  # (rows, cols)
        norms = np.linalg.norm(J, axis=0)
        order = np.argsort(-norms, kind="stable")[:count]
        cols = J[:, order]  # (rows, count)
        cols, _ = orient(cols, cols, J @ x[k])  # each column along what token k produced
        ids, scores = decode_top(cols, W, top)
        for j, c in enumerate(order):
            rows.append({"prompt_id": prompt_id, "target": target or OUTPUT, "token": k, "column": int(c),
                         "norm": float(norms[c]), "decoded": ids[j].tolist(), "scores": scores[j].tolist()})
    return rows


def jacobian_image(store: StoreReader, prompt_id: str, *, target: str | None = None, token: int = -1) -> dict[str, Any]:
    """``J_k`` (rows, cols) of one token, its singular values and stable rank, for the image of
    :func:`~detjac.analysis.view_plots.plot_jacobian_image`."""
    prompt = store.get(prompt_id)
    k = _token_index(prompt, token)
    J = np.asarray(operator(prompt, k, target).compute(), dtype=np.float64)
    s = np.linalg.svd(J, compute_uv=False)
    return {"matrix": J, "singular_values": s, "stable_rank": dimensionality(s).stable_rank, "token": k,
            "target": target or OUTPUT, "prompt": prompt.prompt}


def singular_path(store: StoreReader, prompt_id: str, *, kind: str = "layer", k: int = 2,
                  top: int = 3) -> dict[str, Any]:
    """Each stored ``kind.L`` target's top-``k`` left singular vectors projected on the last layer's.

    Returns
    -------
    dict
        ``layers`` (the stored layers, ascending), ``projections`` (layers, k): ``u_i(L) . u_i(last)``,
        ``decoded`` (layers, k, top) token ids of each ``u_i(L)`` and ``kind``.

    Raises
    ------
    InvalidArgumentError
        A kind that is not a cumulative layerwise kind, or fewer than two stored layers of it.
    """
    prompt = store.get(prompt_id)
    parsed = Target.parse(f"{kind}.0")  # an unknown kind is refused with the valid ones
    if parsed.local or parsed.is_to_output:
        raise InvalidArgumentError(f"Expected a cumulative layerwise kind such as layer or layer_normed (the path "
                                   f"is w.r.t. the input embeddings). Got {kind!r}.")
    layers = sorted(t.layer for t in map(Target.parse, prompt.layerwise_targets) if t.kind == kind)
    if len(layers) < 2:
        raise InvalidArgumentError(f"Expected {kind}.L targets of at least two layers with prompt {prompt_id}. Got "
                                   f"{', '.join(prompt.layerwise_targets) or 'none'}: run with --layers all "
                                   f"--components {kind}.")
    names = [f"{kind}.{layer}" for layer in layers]
    U = np.stack([target_spectrum(store, prompt_id, name, max(k, 4))["U"][:, :k] for name in names])  # (L, d, k)
    k = U.shape[2]
    projections = np.einsum("ldk,dk->lk", U, U[-1])
    W = lens(store, names[0])[0]
    decoded = np.stack([decode_top(U[i], W, top)[0] for i in range(len(layers))])  # (L, k, top)
    return {"layers": layers, "projections": projections, "decoded": decoded, "kind": kind, "k": k}
