"""The chunked vocabulary scans of :mod:`detjac.singular` equal a whole product: :func:`~detjac.singular.rank_of`
(the lens's rank of the model's prediction) and :func:`~detjac.singular.decode_top`, with ties and chunk edges."""

from __future__ import annotations

import numpy as np
import pytest

from detjac import singular


class Rows:
    """Rows read on demand, as the layer-streamed engine hands a vocabulary matrix out."""

    def __init__(self, m: np.ndarray) -> None:
        self.m, self.shape, self.dtype, self.reads = m, m.shape, m.dtype, 0

    def __getitem__(self, index: slice) -> np.ndarray:
        self.reads += 1
        return self.m[index]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ranks_and_tops_in_chunks_equal_the_whole_product(monkeypatch, dtype):
    rng = np.random.default_rng(0)
    W = rng.standard_normal((1000, 16)).astype(dtype)
    W[7] = W[400]  # a tie across chunks, W[7] first
    V = rng.standard_normal((16, 5))
    V[:, 0] = V[:, 1] = W[400]
    monkeypatch.setattr(singular, "VOCAB_CHUNK_BYTES", 16 * 8 * 64)  # 64 rows a chunk: 16 chunks
    whole = (W.astype(np.float64) @ V).T  # (5, vocab)
    tokens = np.array([400, 7, 999, 0, int(np.argmax(whole[4]))])
    expected = [int((row > row[t]).sum()) + 1 for row, t in zip(whole, tokens, strict=True)]
    rows = Rows(W)
    assert singular.rank_of(V, rows, tokens).tolist() == expected
    assert expected[4] == 1 and expected[0] == expected[1]  # the tied rows share their rank
    assert rows.reads == 16 + len({t // 64 for t in tokens})  # one pass, and the tokens' own chunks
    ids, _ = singular.decode_top(V, Rows(W), 5)
    assert ids.tolist() == np.argsort(-whole, axis=1, kind="stable")[:, :5].tolist()
    with pytest.raises(ValueError, match="Expected one token id below 1000"):
        singular.rank_of(V, W, [1000, 0, 0, 0, 0])


def test_many_ties_within_a_chunk_keep_vocabulary_order(monkeypatch):
    """decode_top selects each chunk's candidates in linear time: every tie of the top-th value is kept, so the
    result is a stable sort's whatever the ties."""
    rng = np.random.default_rng(1)
    W = rng.integers(-2, 3, (600, 4)).astype(np.float64)  # few distinct scores: ties everywhere
    V = rng.integers(-1, 2, (4, 7)).astype(np.float64)
    monkeypatch.setattr(singular, "VOCAB_CHUNK_BYTES", 4 * 8 * 100)  # 100 rows a chunk
    ids, scores = singular.decode_top(V, W, 12)
    whole = (W @ V).T
    assert ids.tolist() == np.argsort(-whole, axis=1, kind="stable")[:, :12].tolist()
    assert np.array_equal(scores, np.take_along_axis(whole, ids, axis=1))
