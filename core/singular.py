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


# the vocabulary is decoded this many bytes of widened (float64 at most) rows at a time
VOCAB_CHUNK_BYTES = 32 * 2**20


def decode_top(vectors: Any, matrix: Any, top: int) -> tuple[Any, Any]:
    """Top token ids and scores of each column of ``vectors`` (d, k) through ``matrix`` (vocab, d).

    The one decoding rule of detjac: a vector's tokens are the rows of ``matrix`` (an unembedding or an
    input embedding) with the highest scores ``matrix @ v``, highest first, ties in vocabulary order. The
    scores are computed in the wider of the two dtypes (float32 at least), so a float64 vector is decoded in
    float64 without a float64 copy of a float32 matrix being needed otherwise. Takes numpy arrays (the
    engine passes its tensors through :func:`detjac.engine.products.decode.decode_top`), or any matrix with
    ``shape`` and ``m[start:stop]`` giving numpy rows (the layer-streamed engine's rows read on demand): the
    vocabulary is crossed :data:`VOCAB_CHUNK_BYTES` of widened rows at a time, keeping each column's best ``top``
    so far, so neither the matrix nor its scores are ever whole in the wider dtype.

    Returns
    -------
    (ids, scores), each (k, min(top, vocab)) numpy arrays.
    """
    import numpy as np

    v = np.asarray(vectors)
    vocab, d = int(matrix.shape[0]), int(matrix.shape[1])
    chunk = max(1, top, VOCAB_CHUNK_BYTES // max(1, d * 8))
    ids = np.zeros((v.shape[1], 0), dtype=np.int64)
    scores = np.zeros((v.shape[1], 0))
    for start in range(0, vocab, chunk):
        part, part_ids = _candidates(_chunk_scores(matrix, v, start, chunk).T, start, top)  # (k, rows)
        # the best so far come first (lower ids): a stable sort keeps ties in vocabulary order
        both = np.concatenate([scores.astype(part.dtype, copy=False), part], axis=1)
        both_ids = np.concatenate([ids, part_ids], axis=1)
        order = np.argsort(-both, axis=1, kind="stable")[:, :min(top, both.shape[1])]
        ids, scores = np.take_along_axis(both_ids, order, axis=1), np.take_along_axis(both, order, axis=1)
    return ids, scores


def _chunk_scores(matrix: Any, v: Any, start: int, chunk: int) -> Any:
    """(rows, k) the scores ``matrix[start:start + chunk] @ v``, in the wider of the two dtypes (float32 at least):
    the one scoring rule of :func:`decode_top` and :func:`rank_of`."""
    import numpy as np

    m = np.asarray(matrix[start:min(int(matrix.shape[0]), start + chunk)])
    dtype = np.result_type(m.dtype, v.dtype, np.float32)
    return m.astype(dtype, copy=False) @ v.astype(dtype, copy=False)


def _candidates(part: Any, start: int, top: int) -> tuple[Any, Any]:
    """(values, ids) of each row's entries of ``part`` (k, rows) that can be among its ``top`` best: those at least its
    ``top``-th largest (every tie of it kept), in vocabulary order, padded with ``-inf`` where rows tie more; the
    ids counted from ``start``. A linear-time selection, so that a chunk is never sorted whole."""
    import numpy as np

    k, rows = part.shape
    every = np.broadcast_to(np.arange(start, start + rows), part.shape)
    if rows <= 2 * top:
        return part, every
    threshold = np.partition(part, rows - top, axis=1)[:, rows - top]
    if np.isnan(threshold).any():
        return part, every
    mask = part >= threshold[:, None]
    counts = mask.sum(1)
    r, c = np.nonzero(mask)  # row by row, ids ascending
    slot = np.arange(len(r)) - np.repeat(np.cumsum(counts) - counts, counts)
    values = np.full((k, int(counts.max())), -np.inf, dtype=part.dtype)
    ids = np.full(values.shape, start + rows, dtype=np.int64)
    values[r, slot], ids[r, slot] = part[r, c], c + start
    return values, ids


def rank_of(vectors: Any, matrix: Any, tokens: Any) -> Any:
    """1-based rank of ``tokens[j]`` among the scores ``matrix @ vectors[:, j]`` (highest first, ties counted in
    its favour), for each column of ``vectors`` (d, k); ``matrix`` (vocab, d) as :func:`decode_top` takes it,
    crossed :data:`VOCAB_CHUNK_BYTES` of widened rows at a time. Each token's own score is the one its chunk computes
    in the count, so it never outranks itself.

    Returns
    -------
    (k,) int64 numpy array.
    """
    import numpy as np

    v, tokens = np.asarray(vectors), np.asarray(tokens, dtype=np.int64)
    vocab, d = int(matrix.shape[0]), int(matrix.shape[1])
    chunk = max(1, VOCAB_CHUNK_BYTES // max(1, d * 8))
    if tokens.shape != (v.shape[1],) or ((tokens < 0) | (tokens >= vocab)).any():
        raise ValueError(f"Expected one token id below {vocab} per column ({v.shape[1]}). Got {tokens.tolist()}.")

    own = np.empty(v.shape[1])
    for start in np.unique(tokens // chunk * chunk).tolist():  # the chunks that hold a token: its own score
        part, here = _chunk_scores(matrix, v, start, chunk), np.nonzero(tokens // chunk * chunk == start)[0]
        own[here] = part[tokens[here] - start, here]
    count = np.zeros(v.shape[1], dtype=np.int64)
    for start in range(0, vocab, chunk):
        count += (_chunk_scores(matrix, v, start, chunk) > own).sum(0)
    return count + 1


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
