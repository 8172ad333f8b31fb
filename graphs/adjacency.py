"""The adjacency of an attribution graph (:mod:`detjac.graphs.build`): the kept neurons' read and write
rows, an affine family's bias nodes, the cut pullbacks grouped into passes, and the rows per pass a budget holds.
Definitions: docs/graphs.md, "How it is computed"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from detjac.engine import (
    EMBEDDINGS,
    OUTPUT,
    Engine,
    FrozenValues,
    PullRequest,
    Seed,
    Site,
    decode_top,
    device_key,
    input_of,
    neurons,
    residual_ends,
)
from detjac.errors import InvalidArgumentError, UnsupportedModelError
from detjac.graph_nodes import BIAS, LOGIT, NEURON, TOKEN, NodeKind
from detjac.progress import progress_bar
from detjac.tokens import token_labels

from .prune import prune_bytes
from .targets import LogitTargets, chosen_values

ROWS_PER_PASS = 128  # rows of the adjacency pulled back together (without a memory budget)
LABEL_TOKENS = 3  # tokens in a neuron's label, each way


def sized_rows(engine: Engine, n: int, max_nodes: int, max_logits: int, acts: dict[int, torch.Tensor],
               rows: int | None) -> int:
    """Adjacency rows per pass, counted with everything else the graph holds against the memory budget: the
    engine's own needs (:meth:`~detjac.engine.Engine.sweep_memory`: a layer read in, the trace), every layer's
    neuron values and MLP output, the chosen neurons' read and write rows, the adjacency (float64, square in the
    nodes, biases included, on the CPU) with what pruning holds beside it (:func:`prune_bytes`) and each row's
    cotangents while it crosses a layer. ``rows`` (the caller's) if given, else all the budget holds (at most one pass
    for every row), else :data:`ROWS_PER_PASS` without a budget. Refuses, before any pullback, a ``max_nodes`` whose
    graph the budget cannot hold beside one row -- without a budget, one the machine's available memory cannot hold
    -- naming the largest ``max_nodes`` that fits (:func:`refuse_nodes`), which is then accepted."""
    from detjac import machine

    left, per_row = engine.sweep_memory(n)
    itemsize, d = engine.dtype.itemsize, engine.d_model
    per_row += 2 * n * d * itemsize  # the adjacency's products of a row's cotangents
    values = sum(z.numel() for z in acts.values()) * itemsize
    neurons = sum(z.numel() for z in acts.values())  # no more can be chosen, whatever max_nodes says
    others = len(bias_nodes(engine, n, 0)) + n + max_logits

    def held(m: int) -> int:  # + ranking's scores, transient
        return values + len(acts) * n * d * itemsize + 2 * min(m, neurons) * d * itemsize

    def graph(m: int) -> int:  # the adjacency and what pruning holds beside it
        size = min(m, neurons) + others
        return size * size * 8 + prune_bytes(size)

    device = device_key(engine.device)
    if device != "cpu":  # the adjacency is the CPU's, the rest the device's
        cpu, named = engine.memory_budget("cpu"), True
        if cpu is None:
            cpu, named = machine.available_memory(), False
        if cpu is not None and graph(max_nodes) > cpu:
            where = f"the CPU budget ({cpu / 2**20:.0f} MiB)" if named else \
                f"this machine's available memory ({cpu / 2**20:.0f} MiB; --max-memory cpu=... sets a budget)"
            refuse_nodes(max_nodes, lambda m: graph(m) <= cpu, graph, where)
        need = lambda m: max(held(m), 3 * values) + per_row  # noqa: E731
    else:
        need = lambda m: max(held(m) + graph(m), 3 * values) + per_row  # noqa: E731
    limit = left if left is not None else machine.available_memory()
    if limit is not None and need(max_nodes) > limit:
        if values + per_row > limit:
            raise InvalidArgumentError(
                f"Expected a memory budget that holds the graph's neuron values beside one adjacency row at {n} "
                f"tokens ({(values + per_row) / 2**20:.0f} MiB on {device}). Got {limit / 2**20:.0f} MiB "
                + ("left once the engine's layer and trace are counted." if left is not None else
                   "available on this machine (--max-memory sets a budget).")
            )
        where = (f"the {device} budget left once the engine's layer and trace are counted ({left / 2**20:.0f} MiB)"
                 if left is not None else f"this machine's available memory ({limit / 2**20:.0f} MiB; "
                 "--max-memory sets a budget)")
        refuse_nodes(max_nodes, lambda m: need(m) <= limit, need, where)
    if left is None:
        return rows or ROWS_PER_PASS
    return rows or max(1, min((left - need(max_nodes) + per_row) // per_row, max_nodes + max_logits))


def refuse_nodes(max_nodes: int, fits: Callable[[int], bool], need: Callable[[int], int], where: str) -> None:
    """Refuse ``max_nodes``, naming the largest number of nodes for which ``fits`` holds (``fits`` grows false with
    the nodes: the number named is then accepted) and what ``need`` says each takes."""
    low, high = 0, max_nodes  # fits(low) or low == 0; not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    most = low if fits(low) else 0
    raise InvalidArgumentError(
        f"Expected a --max-nodes whose graph fits in {where}: the adjacency and what pruning holds beside it, with "
        f"the neuron values, MLP outputs and one row. Got {max_nodes}, which needs {need(max_nodes) / 2**20:.0f} MiB; "
        + (f"at most {most} fit." if most else "none fit.")
    )


@dataclass
class Sites:
    """What the adjacency needs of each layer's chosen neurons: their read and write rows (m, d) and the MLP's
    output (n, d) on the prompt (for the sum over every neuron of the layer); for an affine family, each layer's
    constants with its neurons held (n, d) and each chosen neuron's value on a zero layer input (M,)."""

    reads: dict[int, torch.Tensor]
    writes: dict[int, torch.Tensor]
    outputs: dict[int, torch.Tensor]
    labels: list[str]
    layer_bias: dict[int, torch.Tensor] = field(default_factory=dict)
    neuron_bias: torch.Tensor | None = None


def neuron_sites(engine: Engine, trace: Any, chosen: torch.Tensor, acts: dict[int, torch.Tensor]) -> Sites:
    """One pass over the layers: each chosen neuron's read and write rows and label, each layer's MLP output (and
    an affine family's constants)."""
    mats = engine.decoding_rows(torch.float32)  # a block of rows at a time where the engine keeps a budget
    W_U, W_E = mats["unembedding"], mats["embedding"]
    reads, writes, outputs, layer_bias = {}, {}, {}, {}
    order: list[torch.Tensor] = []  # the chosen rows of each layer, in the order their directions are kept
    out_dirs: list[torch.Tensor] = []
    in_dirs: list[torch.Tensor] = []
    affine = bool(engine.family.affine)
    neuron_bias = torch.zeros(chosen.shape[0], dtype=engine.dtype) if affine else None
    for layer, _, mlp in neurons(engine, trace):
        try:  # the MLP piece (the layer's widened weights) let go before the next layer is widened
            outputs[layer] = mlp.output(acts[layer])
            if affine:
                if getattr(mlp, "layer_bias", None) is None:
                    raise UnsupportedModelError(
                        f"Expected every layer's MLP known as one for an affine family's bias nodes. Got layer {layer} "
                        f"of {engine.family.name}, whose MLP's down projection was not found.")
                layer_bias[layer] = mlp.layer_bias
            rows = (chosen[:, 0] == layer).nonzero().reshape(-1)
            if rows.numel() == 0:
                continue
            pos, idx = chosen[rows, 2].to(acts[layer].device), chosen[rows, 1].to(acts[layer].device)
            reads[layer], writes[layer] = mlp.read_rows(pos, idx), mlp.write_rows(pos, idx)
            if neuron_bias is not None:
                neuron_bias[rows] = mlp.neuron_bias[pos, idx].cpu().to(neuron_bias.dtype)
            order.append(rows)
            out_dirs.append(writes[layer].float().cpu())
            in_dirs.append(reads[layer].float().cpu())
        finally:
            del mlp
    labels = ["" for _ in range(chosen.shape[0])]
    if order:  # every layer's neurons decoded in one pass over each vocabulary matrix
        out_top = decode_top(torch.cat(out_dirs).T, W_U, 4 * LABEL_TOKENS)[0]  # (M, 4 * LABEL_TOKENS) token ids
        in_top = decode_top(torch.cat(in_dirs).T, W_E, 4 * LABEL_TOKENS)[0]
        for r, o, i in zip(torch.cat(order).tolist(), out_top.tolist(), in_top.tolist(), strict=True):
            labels[r] = f"writes {readable(engine, o)} · reads {readable(engine, i)}"
    return Sites(reads, writes, outputs, labels, layer_bias, neuron_bias)


def bias_nodes(engine: Engine, n: int, position: int) -> np.ndarray:
    """(B, 2) the bias nodes' (layer, position): every layer at every position, then the final norm's at the
    predicted position; none for a linear family."""
    if not engine.family.affine:
        return np.zeros((0, 2), dtype=np.int64)
    L = engine.n_layers
    grid = np.stack(np.meshgrid(np.arange(L), np.arange(n), indexing="ij"), axis=-1).reshape(-1, 2)
    return np.concatenate([grid, [[L, position]]]).astype(np.int64)


@dataclass(frozen=True)
class Layout:
    """Where each kind of node sits in the adjacency: neurons, bias nodes, tokens, logits."""

    M: int
    B: int
    n: int
    K: int

    @property
    def tokens(self) -> int:
        return self.M + self.B

    @property
    def logits(self) -> int:
        return self.M + self.B + self.n

    @property
    def size(self) -> int:
        return self.logits + self.K

    def bias(self, layer: Any, positions: Any) -> Any:
        """The bias nodes of ``layer`` (< n_layers) at ``positions`` (each may be an array)."""
        return self.M + layer * self.n + positions

    @property
    def final_bias(self) -> int:
        """The final norm's bias node (the last bias node)."""
        return self.M + self.B - 1

    @classmethod
    def of(cls, chosen: torch.Tensor, targets: LogitTargets, sites: Sites, n: int, L: int) -> Layout:
        """The layout of a graph of ``chosen`` neurons and ``targets``: bias nodes (every layer at every position,
        then the final norm's: :func:`bias_nodes`) where ``sites`` hold an affine family's constants."""
        return cls(chosen.shape[0], (L * n + 1) if sites.layer_bias else 0, n, len(targets.ids))

    def receiving(self, rows: np.ndarray) -> np.ndarray:
        """Adjacency rows (neurons, logits) -> positions in the (M + K,) per-receiving-node arrays."""
        return np.where(rows < self.M, rows, rows - self.B - self.n)

    def kind_of(self, row: int) -> tuple[NodeKind, int]:
        """The node kind (:mod:`detjac.graph_nodes`, by its ``span``) of adjacency row ``row``, and the row's place
        within its kind's block: the one place a row's kind is read from the offsets."""
        for kind, start, count in ((NEURON, 0, self.M), (BIAS, self.M, self.B), (TOKEN, self.tokens, self.n),
                                   (LOGIT, self.logits, self.K)):
            if start <= row < start + count:
                return kind, row - start
        raise IndexError(f"row {row} of a {self.size}-node graph")


def adjacency(engine: Engine, trace: Any, targets: LogitTargets, acts: dict[int, torch.Tensor], chosen: torch.Tensor,
              sites: Sites, rows_per_pass: int, progress: bool, system: FrozenValues | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """(adjacency, totals): one cut pullback per logit and per chosen neuron, read at every layer's output (= its
    MLP's output, the MLPs being cut), at the embeddings, and for an affine family at the first layer's input (the
    constants before it). ``totals`` (M + K,): each neuron's and logit's incoming edges summed over *every* source
    of the model, the kept neurons' and the others' (what :func:`completeness` compares with the values). The
    sources' values are the prompt's, or ``system``'s (the same frozen system with the first position set aside:
    ``acts``, ``sites`` and ``targets`` then hold its values too)."""
    n, L = trace.n_tokens, engine.n_layers
    at = Layout.of(chosen, targets, sites, n, L)
    affine = at.B > 0
    A = np.zeros((at.size, at.size))
    total = np.zeros(at.M + at.K)  # each receiving node's incoming edges over every source of the model
    columns = {layer: (chosen[:, 0] == layer).nonzero().reshape(-1) for layer in range(L)}
    values = chosen_values(acts, chosen)
    x = trace.embeddings if system is None else system.embeddings
    if system is not None:
        first, last = system.inputs[0], system.inputs[-1]
    else:
        first, last = residual_ends(engine, trace) if affine else (None, None)
    positions = np.arange(n)

    def add(rows: np.ndarray, cols: np.ndarray | int, edges: torch.Tensor) -> None:
        """Edges (rows, cols) into the adjacency and every receiving node's total."""
        e = edges.cpu().double().numpy().reshape(len(rows), -1)
        A[np.ix_(rows, np.atleast_1d(cols))] += e
        total[at.receiving(rows)] += e.sum(1)

    passes = cut_pullbacks(chosen, targets, sites, rows_per_pass, n, L)
    bar = progress_bar(None, progress, "graph", "pass", total=len(passes))
    try:
        for requests, row_ids in passes:
            for j, site, g in engine.pulls(trace, requests):
                rows = row_ids[j]
                if site == EMBEDDINGS:
                    edges = (g * x[None]).sum(-1)  # (B, n)
                    add(rows, at.tokens + positions, edges)
                    if affine:  # the constants before the first layer: g_h0 · h0 - g_x · x, position by position
                        add(rows, at.bias(0, positions), -edges)
                    continue
                if site == input_of(0):  # an affine family's first layer's input
                    add(rows, at.bias(0, positions), (g * first[None]).sum(-1))
                    continue
                layer = site.layer - 1  # a layer's output: its MLP's output, every MLP being held at its neurons
                total[at.receiving(rows)] += (g * sites.outputs[layer][None]).sum((1, 2)).cpu().double().numpy()
                cols = columns[layer]
                if cols.numel():  # act_c · (g at the neuron's position) · its write row
                    picked = torch.einsum("bmd,md->bm", g[:, chosen[cols, 2].to(g.device)], sites.writes[layer])
                    A[np.ix_(rows, cols.numpy())] = (picked * values[cols].to(g)).cpu().double().numpy()
                if affine:
                    add(rows, at.bias(layer, positions), (g * sites.layer_bias[layer][None]).sum(-1))
                    if layer == L - 1 and rows[0] >= at.logits:  # the final norm's shift: value - g_L · h_L
                        own = targets.values[torch.as_tensor(rows - at.logits, device=targets.values.device)]
                        rest = own.to(g) - (g * last[None]).sum((1, 2))
                        add(rows, at.final_bias, rest)
            if bar is not None:
                bar.update()
    finally:
        if bar is not None:
            bar.close()
    if affine and at.M:  # each neuron's own layer's constants (its value on a zero layer input)
        own = at.bias(chosen[:, 0].numpy(), chosen[:, 2].numpy())
        nb = sites.neuron_bias.cpu().double().numpy() if sites.neuron_bias is not None else np.zeros(at.M)
        A[np.arange(at.M), own] += nb
        total[:at.M] += nb
    return A, total


def completeness(A: np.ndarray, totals: np.ndarray, values: np.ndarray, n_logits: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(completeness, kept share), each (M + K,) over the neurons then the logits, ``values`` (M + K,) their
    values: ``|totals - values| / |values|`` (0: the edges over every source sum to the value exactly) and the share
    of each value that the edges from the graph's own nodes carry."""
    scale = np.maximum(np.abs(values), np.finfo(np.float64).tiny)
    size, M = A.shape[0], len(values) - n_logits
    receiving = np.r_[np.arange(M), size - n_logits + np.arange(n_logits)]
    kept_share = A.sum(1)[receiving] / np.where(values != 0, values, 1.0)
    return np.abs(totals - values) / scale, kept_share


def cut_pullbacks(chosen: torch.Tensor, targets: LogitTargets, sites: Sites, rows_per_pass: int, n: int, L: int
                  ) -> list[tuple[list[PullRequest], list[np.ndarray]]]:
    """The cut pullbacks, grouped into passes of at most ``rows_per_pass`` rows: the logits first (seeded at the
    output), then the chosen neurons a layer at a time (seeded with their read rows at the layer's mid residual,
    reading the outputs of the layers below; an affine family's also the first layer's input)."""
    at = Layout.of(chosen, targets, sites, n, L)
    K, affine = at.K, at.B > 0
    cut = frozenset({"mlp"})
    start = (input_of(0),) if affine else ()
    jobs: list[tuple[PullRequest, np.ndarray]] = []
    for k0 in range(0, K, rows_per_pass):
        k1 = min(K, k0 + rows_per_pass)
        reads = (*start, *(input_of(layer + 1) for layer in range(L)), EMBEDDINGS)
        jobs.append((PullRequest((Seed(OUTPUT, targets.vectors[k0:k1]),), reads, cut), at.logits + np.arange(k0, k1)))
    for layer in range(L):
        idx = (chosen[:, 0] == layer).nonzero().reshape(-1)
        for c0 in range(0, idx.numel(), rows_per_pass):
            part = idx[c0:c0 + rows_per_pass]
            read = sites.reads[layer][c0:c0 + rows_per_pass]  # (m, d), in the order of idx
            seed = read.new_zeros(part.numel(), n, read.shape[1])
            seed[torch.arange(part.numel()), chosen[part, 2]] = read
            reads = (*start, *(input_of(below + 1) for below in range(layer)), EMBEDDINGS)
            jobs.append((PullRequest((Seed(Site("mid", layer), seed),), reads, cut), part.numpy()))
    passes: list[tuple[list[PullRequest], list[np.ndarray]]] = []
    for request, rows in jobs:  # requests share a pass (one sweep, each layer read once) while the rows fit
        if passes and sum(r.rows for r in passes[-1][0]) + request.rows <= rows_per_pass:
            passes[-1][0].append(request)
            passes[-1][1].append(rows)
        else:
            passes.append(([request], [rows]))
    return passes


def readable(engine: Engine, ids: list[int]) -> str:
    """The first :data:`LABEL_TOKENS` of ``ids`` whose text is whole (not a fragment of a multi-byte character),
    quoted; the first ones whatever they are when none is."""
    texts = token_labels(engine.tokenizer, ids)
    whole = [t for t in texts if t.strip() and t.isprintable() and "\ufffd" not in t] or texts
    return " ".join(repr(t) for t in whole[:LABEL_TOKENS])
