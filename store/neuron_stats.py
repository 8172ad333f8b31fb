"""A neuron index's running statistics (``detjac neurons``): per MLP neuron, its top-K contexts of each sign, a
histogram of its values, how often it is positive or negative, and its sum and sum of squares; numpy only.

Bounded whatever the corpus: (layers, neurons, 2, K) top entries and (layers, neurons, bins) counts, never the
values themselves. Exact under merging: a context's rank is the total order (|value| descending, prompt ascending,
position ascending), so the top-K of a union is the top-K of the parts' top-Ks whatever the order they are merged
in, and the counts are integers; only the sums of values and squares depend on the order, to float64 rounding.
The format these arrays are stored in: docs/store-format.md, "Neuron indexes"."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Histogram edges: 0 and ±10^(-3 .. 3), four bins a decade; 51 bins (below -1e3, ..., (-1e-3, 1e-3), ..., above 1e3).
EDGES = np.concatenate([-np.logspace(3, -3, 25), np.logspace(-3, 3, 25)])
N_BINS = EDGES.size + 1
SIGNS = ("positive", "negative")
ARRAYS = ("top_value", "top_prompt", "top_position", "histogram", "n_positive", "n_negative", "sum", "sum_squares")


@dataclass
class NeuronStats:
    """The statistics of ``n_tokens`` token positions (see the module docstring).

    Attributes
    ----------
    top_value : numpy.ndarray
        (layers, neurons, 2, K) float64: ``[..., 0, :]`` the largest positive values, ``[..., 1, :]`` the most
        negative, best first; 0 in an empty slot (fewer than K positions of that sign).
    top_prompt, top_position : numpy.ndarray
        (layers, neurons, 2, K) int64: the prompt (its index in the corpus) and token position of each; -1 if empty.
    histogram : numpy.ndarray
        (layers, neurons, N_BINS) int64 counts of the values between :data:`EDGES`.
    n_positive, n_negative : numpy.ndarray
        (layers, neurons) int64 positions where the value is > 0, < 0.
    sum, sum_squares : numpy.ndarray
        (layers, neurons) float64.
    n_tokens : int
        Token positions counted (every layer sees each once).
    """

    top_value: np.ndarray
    top_prompt: np.ndarray
    top_position: np.ndarray
    histogram: np.ndarray
    n_positive: np.ndarray
    n_negative: np.ndarray
    sum: np.ndarray
    sum_squares: np.ndarray
    n_tokens: int = 0

    @classmethod
    def empty(cls, n_layers: int, n_neurons: int, k: int) -> NeuronStats:
        shape = (n_layers, n_neurons)
        return cls(np.zeros((*shape, 2, k)), np.full((*shape, 2, k), -1, dtype=np.int64),
                   np.full((*shape, 2, k), -1, dtype=np.int64), np.zeros((*shape, N_BINS), dtype=np.int64),
                   np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64), np.zeros(shape), np.zeros(shape))

    @property
    def k(self) -> int:
        return int(self.top_value.shape[-1])

    def add(self, layer: int, prompt: int, z: np.ndarray) -> None:
        """Count ``z`` (n, neurons), the values of ``layer``'s neurons at the n positions of prompt ``prompt``."""
        self.add_rows(layer, np.full(z.shape[0], prompt, dtype=np.int64), np.arange(z.shape[0]), z)

    def add_rows(self, layer: int, prompts: np.ndarray, positions: np.ndarray, z: np.ndarray) -> None:
        """Count ``z`` (rows, neurons): ``layer``'s neuron values at the rows' (prompt, position)s."""
        m = z.shape[1]
        self.histogram[layer] += np.bincount((np.arange(m) * N_BINS + np.searchsorted(EDGES, z, side="right")).ravel(),
                                             minlength=m * N_BINS).reshape(m, N_BINS)
        self.n_positive[layer] += (z > 0).sum(axis=0)
        self.n_negative[layer] += (z < 0).sum(axis=0)
        self.sum[layer] += z.sum(axis=0)
        self.sum_squares[layer] += (z * z).sum(axis=0)
        p = np.broadcast_to(np.asarray(prompts, dtype=np.int64)[:, None], z.shape)
        q = np.broadcast_to(np.asarray(positions, dtype=np.int64)[:, None], z.shape)
        for sign, score in enumerate((z, -z)):
            self._offer(layer, sign, *_best_rows(score, p, q, self.k))

    def _offer(self, layer: int, sign: int, score: np.ndarray, prompts: np.ndarray, positions: np.ndarray) -> None:
        """Merge candidates (c, neurons) scored ``score`` (|value| when of this sign, else <= 0) into the top-K."""
        best = self.top_value[layer, :, sign] * (1 - 2 * sign)  # (neurons, K) as scores, >= 0
        kth = best[:, -1]
        cols = ((score > 0) & (score >= kth[None, :])).any(axis=0).nonzero()[0]
        if cols.size == 0:
            return
        s = np.concatenate([best[cols].T, np.where(score[:, cols] > 0, score[:, cols], 0.0)])  # (K + c, m)
        p = np.concatenate([self.top_prompt[layer, cols, sign].T, prompts[:, cols]])
        q = np.concatenate([self.top_position[layer, cols, sign].T, positions[:, cols]])
        empty = s <= 0
        p, q = np.where(empty, -1, p), np.where(empty, -1, q)
        # the total order: score descending, then prompt, then position ascending (empty slots last)
        order = np.lexsort((q, np.where(empty, np.iinfo(np.int64).max, p), -s), axis=0)[:self.k]
        self.top_value[layer, cols, sign] = (np.take_along_axis(s, order, 0) * (1 - 2 * sign)).T
        self.top_prompt[layer, cols, sign] = np.take_along_axis(p, order, 0).T
        self.top_position[layer, cols, sign] = np.take_along_axis(q, order, 0).T

    def merge(self, other: NeuronStats) -> None:
        """Add ``other``'s counts to these (exactly: see the module docstring)."""
        if other.top_value.shape != self.top_value.shape:
            raise ValueError(f"Expected statistics of the same shape. Got {other.top_value.shape} and "
                             f"{self.top_value.shape}.")
        for name in ("histogram", "n_positive", "n_negative", "sum", "sum_squares"):
            getattr(self, name).__iadd__(getattr(other, name))
        self.n_tokens += other.n_tokens
        for layer in range(self.top_value.shape[0]):
            for sign in range(2):
                score = other.top_value[layer, :, sign].T * (1 - 2 * sign)  # (K, neurons)
                self._offer(layer, sign, score, other.top_prompt[layer, :, sign].T,
                            other.top_position[layer, :, sign].T)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in ARRAYS}

    @classmethod
    def of(cls, arrays: dict[str, np.ndarray], n_tokens: int) -> NeuronStats:
        return cls(**{name: np.asarray(arrays[name]) for name in ARRAYS}, n_tokens=n_tokens)


def _best_rows(score: np.ndarray, p: np.ndarray, q: np.ndarray, k: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidates (rows, neurons) cut to the k best rows of each column where that is exact (no tie at the k-th),
    all of them otherwise: the top-K of the cut equals that of the whole."""
    if score.shape[0] <= k + 1:
        return score, p, q
    neg = -score.T  # (neurons, rows), contiguous along the rows: a partition per neuron reads memory in order
    part = np.argpartition(neg, k, axis=1)  # [:, :k] the k largest scores (any order), [:, k] the (k+1)-th
    top = part[:, :k]
    s_top = -np.take_along_axis(neg, top, 1)
    nxt = -np.take_along_axis(neg, part[:, k:k + 1], 1)[:, 0]
    tied = (nxt == s_top.min(axis=1)) & (nxt > 0)
    if tied.any():  # an exact tie at the boundary: whichever row wins is decided by the total order, on all rows
        return score, p, q
    rows = top.T  # (k, neurons)
    return s_top.T, np.take_along_axis(p, rows, 0), np.take_along_axis(q, rows, 0)
