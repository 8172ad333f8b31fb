"""The cost model and block sizing of both engines' sweeps.

:class:`CostModel` splits targets between reverse and forward mode and sizes the blocks to a memory budget, from upper
bounds per vector and per layer that depend on the sweeps. Derivation and measurements: docs/engine.md, "Cost model"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from detjac.errors import InvalidArgumentError
from detjac.machine import available_memory
from detjac.targets import DEFAULT_ROW_BLOCK, Target

from .memory import format_bytes
from .pieces import layer as pieces
from .pieces.fold import fold_bytes, fold_pays
from .types import Plan

# Without a budget, a row block holds as many vectors as fit in this many bytes (at least DEFAULT_ROW_BLOCK): each
# block is one more pass over every layer's weights (read, and dequantized again for a quantized file).
UNBUDGETED_BLOCK_BYTES = 512 * 2**20
# ... or, where this machine has more memory free when the block is planned, this share of it: all d rows in one
# block (the MLPs fold) took 0.27-0.57 of the CPU time of blocks of 64 in memory (docs/benchmarks.md, "Default row
# block"), and fewer blocks mean fewer passes over the weights when they are streamed.
UNBUDGETED_SHARE = 0.25
MODES = ("auto", "reverse", "forward")


def depth(t: Target, n_layers: int) -> float:
    """Layers between the target and the vectors' seed, for the cost model."""
    if t.local:
        return 1.0
    if t.is_output:
        return float(n_layers)
    if t.is_to_output:
        return float(n_layers - 1 - t.layer)
    return t.layer + (0.5 if t.base in ("attn", "resid_mid") else 1.0)


def reverse_only(t: Target, targets: Sequence[Target]) -> bool:
    """Whether ``t`` is computed in reverse mode whatever the plan: per-layer targets (one layer each),
    ``to_output`` targets and, when one is requested, the output (their rows are its cotangents)."""
    return t.local or t.is_to_output or (t.is_output and any(u.is_to_output for u in targets))


@dataclass(frozen=True)
class CostModel:
    """The shapes that decide cost and memory: hidden and MLP sizes, layers, bytes per number and per layer.

    ``layer_bytes``: one decoder layer in the compute dtype (the layer in use, widened on the compute device);
    ``stored_bytes``: one layer as stored (bfloat16 tensors, a GGUF's quantized blocks; None: ``layer_bytes``), held
    twice (the one in use and the next, read ahead). ``budget`` is the compute device's memory budget in bytes (None:
    no budget).
    """

    d_model: int
    ffn: int
    n_layers: int
    itemsize: int
    layer_bytes: int
    detach: bool = True
    budget: int | None = None
    device: str = "cpu"
    heads: int = 1  # query heads; q, kv: the widths of all query and key-value heads (None: d_model)
    q: int | None = None
    kv: int | None = None
    sweeps: str = "explicit"  # how a block crosses a layer: explicit or autograd (the ordinary Jacobian: autograd)
    stored_bytes: int | None = None

    @property
    def weights_bytes(self) -> int:
        """What the layers' weights hold at once, a layer widened whole: two layers as stored (the one in use, the
        next read ahead) and the one in use widened to the compute dtype (its norm gains folded into it in place: no
        third copy)."""
        return 2 * self.stored_layer_bytes + self.layer_bytes

    @property
    def stored_layer_bytes(self) -> int:
        return self.layer_bytes if self.stored_bytes is None else self.stored_bytes

    @property
    def matrix_bytes(self) -> int:
        """The most a layer widened a matrix at a time holds in the compute dtype at once: an MLP's two projections
        (its crossing alternates their GEMMs a chunk at a time; also Phi3's fused gate_up) or a fused qkv projection,
        and the layer's vectors (norm gains, widened with the layer: at most 8 d numbers)."""
        d, q, kv = self.d_model, self.q or self.d_model, self.kv or self.d_model
        return self.itemsize * (max(2 * d * self.ffn, d * (q + 2 * kv)) + 8 * d)

    def per_matrix(self, n: int) -> bool:
        """Whether the layers are widened a matrix at a time, each just before its use, at ``n`` tokens (else the layer
        in use is widened whole, once per block); the one place this is decided (docs/engine.md, "Cost model").

        Only under a budget. A matrix at a time, a layer is widened about twice per block (the forward that records its
        factors, then its crossing), so it is chosen where it needs at most half the blocks: where a layer widened
        whole leaves room for fewer than half the vectors (at most d) that one widened a matrix at a time does."""
        if self.budget is None or self.matrix_bytes >= self.layer_bytes:
            return False
        left = self.budget - self.block_bytes(n, 0)
        whole = max(0, left - self.weights_bytes) // self.vector_bytes(n)
        matrix = max(0, left - 2 * self.stored_layer_bytes - self.matrix_bytes) // self.vector_bytes(n)
        return 2 * whole < min(self.d_model, matrix)

    def held_weights_bytes(self, n: int) -> int:
        """What the layers' weights hold at once at ``n`` tokens: :attr:`weights_bytes`, or two layers as stored and
        :attr:`matrix_bytes` where :meth:`per_matrix`."""
        return 2 * self.stored_layer_bytes + self.matrix_bytes if self.per_matrix(n) else self.weights_bytes

    @classmethod
    def of(cls, config: Any, itemsize: int, layer_bytes: int, **kw: Any) -> CostModel:
        """The cost model of a transformers ``config`` (hidden, MLP and head widths read from its text config);
        ``kw``: the other fields."""
        text = config.get_text_config()
        d, heads = int(text.hidden_size), int(text.num_attention_heads)
        hd = int(getattr(text, "head_dim", None) or d // heads)
        kv = int(getattr(text, "num_key_value_heads", None) or heads) * hd
        ffn = int(getattr(text, "intermediate_size", None) or 4 * d)
        return cls(d, ffn, int(text.num_hidden_layers), itemsize, layer_bytes, heads=heads, q=heads * hd, kv=kv, **kw)

    @property
    def explicit(self) -> bool:
        return self.sweeps == "explicit" and self.detach

    def folds(self, rows: int) -> bool:
        """Whether a block of ``rows`` vectors crosses each gated MLP folded into one d × d matrix per position
        (:func:`~detjac.engine.pieces.fold.fold_pays`: fewer FLOPs; explicit sweeps only)."""
        return self.explicit and fold_pays(self.d_model, self.ffn, rows)

    def whole_block(self, n: int) -> bool:
        """Whether all d rows go in one block at ``n`` tokens without a budget: they fold (fewer FLOPs than any
        smaller blocks) and fit in :func:`unbudgeted_bytes`."""
        return self.folds(self.d_model) and self.d_model * self.vector_bytes(n) <= unbudgeted_bytes()

    def vector_bytes(self, n: int) -> int:
        """Bytes one vector of the block costs while it crosses one layer at ``n`` tokens."""
        d, q, kv = self.d_model, self.q or self.d_model, self.kv or self.d_model
        if self.explicit:
            return self.itemsize * n * (4 * d + q + kv)
        return self.itemsize * (n * (4 * d + 2 * self.ffn) + self.heads * n * n)

    def layer_bytes_held(self, n: int, vectors: int | None = None) -> int:
        """Bytes a layer's crossing holds beside the block's vectors at ``n`` tokens (its weights aside: see
        :attr:`weights_bytes`); the MLP's chunk is at most the whole intermediate of ``vectors`` vectors (None: any
        number)."""
        d, f, q, kv = self.d_model, self.ffn, self.q or self.d_model, self.kv or self.d_model
        forward = n * (4 * f + 3 * d + q + 2 * kv) + 2 * self.heads * n * n  # the layer run once on n positions
        if not self.explicit:
            return self.itemsize * forward
        chunk = max(pieces.CHUNK_BYTES.get(self.device.split(":")[0], pieces.OTHER_CHUNK_BYTES),
                    pieces.MIN_CHUNK_ROWS * f * self.itemsize)  # the MLP's intermediate, a chunk at a time
        if vectors is not None:
            chunk = min(chunk, vectors * n * f * self.itemsize)
            if self.folds(vectors):  # the folded MLP's scratch instead of the intermediate's chunk
                chunk = max(chunk, fold_bytes(d, f, vectors, n, self.itemsize))
        return self.itemsize * (forward + self.heads * n * n + 2 * n * f) + chunk

    def trace_bytes(self, n: int) -> int:
        """The trace: every layer's input and mid residual, and the final states (n × d each)."""
        return (2 * self.n_layers + 2) * n * self.d_model * self.itemsize

    def block_bytes(self, n: int, vectors: int) -> int:
        """What a block of ``vectors`` adds at ``n`` tokens, on top of the layers' weights: the trace, what a layer
        holds, the block's vectors."""
        return self.trace_bytes(n) + self.layer_bytes_held(n, vectors or None) + vectors * self.vector_bytes(n)

    def vector_budget(self, n: int) -> int | None:
        """Bytes left for the block: the budget less the layers' weights (:meth:`held_weights_bytes`), the trace and
        what a layer's crossing holds whatever the block."""
        if self.budget is None:
            return None
        return max(0, self.budget - self.held_weights_bytes(n) - self.block_bytes(n, 0))

    def spare_bytes(self, n: int, plan: Plan | None = None) -> int:
        """What the budget leaves at ``n`` tokens beside the layers' weights (:meth:`held_weights_bytes`), the trace, a
        layer's crossing and the plan's blocks (None: the forward pass alone): the stored layers kept across passes
        (:class:`~detjac.engine.streamed.prefetch.LayerFeed`). Without a budget: 0, none kept."""
        budget = self.vector_budget(n)
        if budget is None:
            return 0
        vectors = 0 if plan is None else max(plan.row_block * len(plan.reverse) if plan.reverse else 0,
                                             plan.token_block * self.d_model if plan.forward else 0)
        return max(0, budget - vectors * self.vector_bytes(n))

    def forward_vectors(self, n: int, token_block: int) -> float:
        """Forward mode's vectors per layer, in units of n positions: a block of tokens ``k0:k1`` carries
        ``(k1 - k0) * d`` tangents over positions ``k0:`` only (causal truncation, detached models)."""
        if not self.detach:
            return float(n * self.d_model)
        return sum(min(token_block, n - k0) * self.d_model * (n - k0) / n for k0 in range(0, n, token_block))

    def plan(self, n: int, targets: Sequence[Target], *, mode: str = "auto", row_block: int | None = None,
             token_block: int | None = None) -> Plan:
        """Split ``targets`` between reverse and forward mode and size the blocks for a prompt of ``n`` tokens.

        Raises
        ------
        InvalidArgumentError
            An unknown mode, a non-positive block, or a budget too small for one layer and one block.
        """
        check_request(mode, row_block, token_block)
        d, L = self.d_model, self.n_layers
        cumulative = [t for t in targets if not reverse_only(t, targets)]
        budget = self.vector_budget(n)
        rows_fit = budget // self.vector_bytes(n) if budget is not None else None
        if token_block is None:
            token_block = max(1, n // 4) if rows_fit is None else min(n, rows_fit // d)
        reverse_cost = d * sum(depth(t, L) for t in cumulative)
        forward_cost = self.forward_vectors(n, max(1, token_block)) * max((depth(t, L) for t in cumulative),
                                                                          default=0.0)
        forward_ok = mode == "forward" or (mode == "auto" and forward_cost < reverse_cost
                                           and (rows_fit is None or rows_fit >= d))
        fwd = sorted(cumulative) if forward_ok and cumulative else []
        rev = sorted(t for t in targets if t not in fwd)
        n_rev = max(1, len(rev))
        if row_block is None:
            if rows_fit is None:
                row_block = min(d, max(DEFAULT_ROW_BLOCK, unbudgeted_bytes() // self.vector_bytes(n) // n_rev))
            else:
                row_block = min(d, rows_fit // n_rev)
            if row_block >= 1:  # as few blocks as fit, evened out (no short last block)
                row_block = -(-d // -(-d // row_block))
        if self.budget is not None and ((rev and row_block < 1) or (fwd and token_block < 1)):
            self.refuse(n, n_rev if rev else d)
        row_block, token_block = max(1, row_block), max(1, token_block)
        widen = "matrix" if self.per_matrix(n) else "layer"
        return Plan(rev, fwd, row_block, token_block, reverse_cost, forward_cost,
                    -(-d // row_block) if rev else 0, -(-n // token_block) if fwd else 0, widen)

    def refuse(self, n: int, vectors: int) -> None:
        """Raise what a budget too small for ``vectors`` vectors at ``n`` tokens must hold, the layer in use widened a
        matrix at a time where that holds less than widened whole.

        Raises
        ------
        InvalidArgumentError
            Always: the weights, the trace and a layer's crossing, the vectors, and the total.
        """
        assert self.budget is not None
        matrix = self.matrix_bytes < self.layer_bytes
        widened = (f"the one in use widened a matrix at a time ({format_bytes(self.matrix_bytes)} at once, of "
                   f"{format_bytes(self.layer_bytes)} in the compute dtype)" if matrix else
                   f"the one in use in the compute dtype ({format_bytes(self.layer_bytes)})")
        weights = 2 * self.stored_layer_bytes + (self.matrix_bytes if matrix else self.layer_bytes)
        total = weights + self.block_bytes(n, 0) + vectors * self.vector_bytes(n)
        raise InvalidArgumentError(
            f"Expected a memory budget that holds two layers as stored ({format_bytes(self.stored_layer_bytes)} each: "
            f"the one in use and the next, read ahead), {widened}, the trace and what a layer's crossing holds at {n} "
            f"token{'s' if n != 1 else ''} ({format_bytes(self.block_bytes(n, 0))}) and at least {vectors} "
            f"vector{'s' if vectors > 1 else ''} of {format_bytes(self.vector_bytes(n))}: {format_bytes(total)} in "
            f"all. Got {format_bytes(self.budget)} for {self.device}: raise --max-memory."
        )


def unbudgeted_bytes() -> int:
    """What a row block's vectors may take without a memory budget: :data:`UNBUDGETED_SHARE` of the memory this
    process may still take now (:func:`detjac.machine.available_memory`: the machine's, or a worker's share of it),
    at least :data:`UNBUDGETED_BLOCK_BYTES`."""
    free = available_memory()
    return max(UNBUDGETED_BLOCK_BYTES, int((free or 0) * UNBUDGETED_SHARE))


def check_request(mode: str, row_block: int | None, token_block: int | None) -> None:
    """A known mode, and blocks that are None (sized by the plan) or positive integers."""
    if mode not in MODES:
        raise InvalidArgumentError(f"Expected mode auto, reverse or forward. Got {mode!r}.")
    for name, value in (("row_block", row_block), ("token_block", token_block)):
        if value is not None:
            check_positive(name, value)


def check_positive(name: str, value: Any) -> int:
    """``value`` as a positive int (a bool is not one), or an :class:`InvalidArgumentError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"Expected {name} to be a positive integer. Got {value!r} instead.")
    return value
