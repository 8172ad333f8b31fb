"""How a singular pair is oriented and how a vector is decoded to tokens: one rule for the engine and the analyses.

Each pair ``(u_i, v_i)`` is flipped so that ``u_i . r >= 0`` for a reference ``r`` in the output space, normally
``J x``, so decoded tokens are comparable across runs, engines and stores. Details: docs/engine.md, "Decoded singular
triplets"."""

from __future__ import annotations

from typing import Any


def orient(U: Any, V: Any, reference: Any) -> tuple[Any, Any]:
    """Flip the pairs of ``U`` (d_out, k) and ``V`` (d_in, k) so that ``reference @ U >= 0`` column by column.

    Works on torch tensors and numpy arrays alike (``reference`` (d_out,) of the same kind).
    """
    ref = reference.to(U.dtype) if hasattr(reference, "to") else reference.astype(U.dtype)
    sign = 1 - 2 * ((ref @ U) < 0)  # (k,) +1 or -1
    return U * sign, V * sign


def decode_top(vectors: Any, matrix: Any, top: int) -> tuple[Any, Any]:
    """Top token ids and scores of each column of ``vectors`` (d, k) through ``matrix`` (vocab, d).

    The one decoding rule of detjac: a vector's tokens are the rows of ``matrix`` (an unembedding or an
    input embedding) with the highest scores ``matrix @ v``, highest first, ties in vocabulary order. The
    scores are computed in the wider of the two dtypes (float32 at least), so a float64 vector is decoded in
    float64 without a float64 copy of a float32 matrix being needed otherwise. Takes numpy arrays (the
    engine passes its tensors through :func:`detjac.engine.products.decode.decode_top`).

    Returns
    -------
    (ids, scores), each (k, min(top, vocab)) numpy arrays.
    """
    import numpy as np

    m, v = np.asarray(matrix), np.asarray(vectors)
    dtype = np.result_type(m.dtype, v.dtype, np.float32)
    scores = (m.astype(dtype, copy=False) @ v.astype(dtype, copy=False)).T  # (k, vocab)
    top = min(top, scores.shape[1])
    ids = np.argsort(-scores, axis=1, kind="stable")[:, :top]
    return ids, np.take_along_axis(scores, ids, axis=1)


def decode_blocks(V: Any, n_blocks: int, matrix: Any, top: int) -> tuple[Any, Any, Any, Any]:
    """Decode right singular vectors of ``[J_1 ... J_n]``: each column of ``V`` (n_blocks * d, k) through the
    d-block of the token that carries most of its ``|v|^2`` (numpy arrays).

    Returns
    -------
    (ids (k, top), scores (k, top), picks (k,) the chosen block, shares (k,) its share of ``|v|^2``).
    """
    import numpy as np

    V = np.asarray(V)
    blocks = V.T.reshape(V.shape[1], n_blocks, -1)  # (k, n_blocks, d)
    energy = (blocks**2).sum(-1)  # (k, n_blocks)
    picks = energy.argmax(-1)  # (k,)
    chosen = blocks[np.arange(len(picks)), picks].T  # (d, k)
    ids, scores = decode_top(chosen, matrix, top)
    shares = energy[np.arange(len(picks)), picks] / energy.sum(-1)
    return ids, scores, picks, shares
