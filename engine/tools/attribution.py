"""Exact attribution graphs of one prediction: input tokens, MLP neurons and top logits, with no transcoder and no
error nodes.

With attention probabilities, norm scales and every MLP's gate frozen, each MLP neuron ``z = gate · (W_up norm(r))``
is linear in the residual stream, and the model is linear in the input embeddings and the neurons. An edge
``a -> b`` is ``act(a) · ∂value(b)/∂act(a)`` with every MLP's output held at its neurons (the direct effect), so each
node's incoming edges over all sources sum to its value exactly. :func:`attribution_graph` computes the graph with the
pullback primitive (:mod:`detjac.engine.pullback`): one pullback per logit ranks every neuron, then one cut pullback per
kept node gives its row of the adjacency. Definitions: docs/graphs.md."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from detjac.errors import InvalidArgumentError, UnsupportedModelError
from detjac.graph_settings import MAX_NODES
from detjac.progress import progress_bar
from detjac.tokens import token_texts as _texts

from ..interface import Engine, Prompt
from ..pullback import EMBEDDINGS, OUTPUT, PullRequest, Seed, Site, input_of, neurons_of

MAX_LOGITS = 10  # logit targets: the top ones, at most this many ...
LOGIT_PROBABILITY = 0.95  # ... until their probabilities sum to this
ROWS_PER_PASS = 128  # rows of the adjacency pulled back together (without a memory budget)
LABEL_TOKENS = 3  # tokens in a neuron's label, each way


@dataclass
class AttributionGraph:
    """An exact attribution graph (see the module docstring).

    Nodes are ordered neurons (``M``), then bias nodes (``B``: an affine family's only), then tokens (``n``), then
    logits (``K``), as circuit-tracer orders features, error nodes, tokens and logits; ``adjacency[target, source]``
    is the edge weight.

    Attributes
    ----------
    token_ids, tokens : list
        The prompt (n) and each token's text.
    position : int
        The predicted position (the logits' ``ctx_idx``).
    n_layers : int
        Decoder layers (a logit node's layer is ``n_layers + 1``).
    logit_ids : list[int]
        The ``K`` target tokens, most probable first; ``logit_probabilities`` (K,) their probabilities.
    logit_values : numpy.ndarray
        (K,) each target's demeaned logit ``logit_t - mean_v logit_v``: the logit node's value.
    neurons : numpy.ndarray
        (M, 3) each neuron node's (layer, index, position); ``activations`` (M,) its value.
    biases : numpy.ndarray
        (B, 2) each bias node's (layer, position): the constants layer ``l < n_layers`` adds at the position (its
        attention's and MLP's biases, its norms' shifts, with its neurons held; layer 0's also what is added before
        it, position embeddings), and at ``(n_layers, position)`` the final norm's shift. Empty for a linear family.
    adjacency : numpy.ndarray
        (M + B + n + K, M + B + n + K) the direct effects.
    completeness : numpy.ndarray
        (M + K,) for each neuron and logit node ``|sum of its incoming edges over all sources - value| / |value|``:
        the sum runs over *every* neuron of the model, not only the ``M`` kept.
    kept_share : numpy.ndarray
        (M + K,) the share of each node's value that its edges from the graph's nodes carry (1: nothing outside).
    n_active : int
        Neurons with a nonzero value at or before the position (the candidates).
    labels : list[str]
        (M,) each neuron's label: its write vector's top tokens through the unembedding, its read vector's through the
        embedding.
    info : dict
        Model, family, dtype, engine and the settings used.
    """

    token_ids: list[int]
    tokens: list[str]
    position: int
    n_layers: int
    logit_ids: list[int]
    logit_tokens: list[str]
    logit_probabilities: np.ndarray
    logit_values: np.ndarray
    neurons: np.ndarray
    activations: np.ndarray
    adjacency: np.ndarray
    completeness: np.ndarray
    kept_share: np.ndarray
    n_active: int
    labels: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    biases: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))

    @property
    def n_neurons(self) -> int:
        return int(self.neurons.shape[0])

    @property
    def n_biases(self) -> int:
        return int(self.biases.shape[0])

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def n_logits(self) -> int:
        return len(self.logit_ids)

    @property
    def worst_completeness(self) -> float:
        """The largest relative error of a node's incoming edges against its value (0: exact)."""
        return float(self.completeness.max()) if self.completeness.size else 0.0

    def __repr__(self) -> str:
        biases = f", {self.n_biases} bias nodes" if self.n_biases else ""
        return (f"<AttributionGraph {self.n_tokens} tokens, {self.n_neurons} of {self.n_active} active neurons"
                f"{biases}, {self.n_logits} logits; completeness {self.worst_completeness:.1e}>")


def attribution_graph(engine: Engine, prompt: Prompt, *, max_nodes: int = MAX_NODES, max_logits: int = MAX_LOGITS,
                      logit_probability: float = LOGIT_PROBABILITY, rows_per_pass: int | None = None,
                      progress: bool = False) -> AttributionGraph:
    """The exact attribution graph of the prediction at the prompt's last position (see the module docstring).

    Parameters
    ----------
    engine
        Any engine with neuron sites (:attr:`~detjac.engine.Engine.pullback_sites`): explicit detached sweeps.
    prompt
        Text or token ids.
    max_nodes
        Neurons that enter the adjacency, ranked by their total attribution to the logits (probability weighted).
    max_logits, logit_probability
        The logit targets: the most probable tokens, at most ``max_logits``, until their probabilities reach
        ``logit_probability``.
    rows_per_pass
        Adjacency rows pulled back together (memory grows with it); default from the engine's memory budget.
    progress
        Show a progress bar.

    Raises
    ------
    UnsupportedModelError
        A family whose neurons have no definition here (post-norm layers; an MLP not known as one).
    InvalidArgumentError
        A non-positive ``max_nodes`` or ``rows_per_pass``, a probability outside (0, 1], an engine without neuron
        sites (autograd sweeps, ordinary Jacobian), or a ``max_nodes`` the memory budget cannot hold.
    PromptError
        An empty prompt, unknown ids, or more tokens than the model's context.
    """
    _check_settings(engine, max_nodes, max_logits, logit_probability, rows_per_pass)
    trace = engine.trace(prompt, progress=progress)
    n, p = trace.n_tokens, trace.position
    acts = {layer: z for layer, z, _ in engine.neurons(trace)}
    rows = _rows_per_pass(engine, n, max_nodes, max_logits, acts, rows_per_pass)
    targets = _logit_targets(engine, trace.output, max_logits, logit_probability)
    chosen, n_active = _rank(engine, trace, targets, acts, max_nodes)
    sites = _sites(engine, trace, chosen, acts)
    graph = _adjacency(engine, trace, targets, acts, chosen, sites, rows, progress)
    ids = list(trace.token_ids)
    graph_labels = sites.labels
    return AttributionGraph(biases=_bias_nodes(engine, n, p),
        token_ids=ids, tokens=token_texts(engine, ids), position=p, n_layers=engine.n_layers,
        logit_ids=targets.ids, logit_tokens=token_texts(engine, targets.ids),
        logit_probabilities=targets.probabilities, logit_values=targets.values.cpu().double().numpy(),
        neurons=chosen.cpu().numpy(), activations=_chosen_values(acts, chosen).cpu().double().numpy(),
        adjacency=graph[0], completeness=graph[1], kept_share=graph[2], n_active=n_active, labels=graph_labels,
        info={"family": engine.family.name, "model_type": engine.config.model_type,
              "dtype": str(engine.dtype).removeprefix("torch."), "n_layers": engine.n_layers,
              "d_model": engine.d_model, "max_nodes": max_nodes, "engine": type(engine).__name__},
    )


def check_graph_request(engine: Engine, max_nodes: int = MAX_NODES) -> None:
    """Raise, before any work, what :func:`attribution_graph` would raise for ``engine`` and ``max_nodes``
    whatever the prompt (``detjac run --graph`` checks it before a store is touched).

    Raises
    ------
    UnsupportedModelError
        A family whose neurons have no definition here.
    InvalidArgumentError
        A non-positive ``max_nodes``, or an engine without neuron sites.
    """
    _check_settings(engine, max_nodes, MAX_LOGITS, LOGIT_PROBABILITY, None)


def token_texts(engine: Engine, ids: list[int]) -> list[str]:
    """Each token id's text (``' Paris'``, :func:`detjac.tokens.token_texts`), or the id itself where the model has
    no tokenizer."""
    return _texts(engine.tokenizer, ids) or [str(i) for i in ids]


def _check_settings(engine: Engine, max_nodes: int, max_logits: int, probability: float, rows: int | None) -> None:
    family = engine.family
    if family.post_norm:
        raise UnsupportedModelError(
            f"Expected a family whose MLP neurons detjac defines for attribution graphs (pre-norm layers: an MLP "
            f"reading a normed copy of the residual stream). Got {family.name}: post-norm layers, whose MLP output "
            "is normed together with the residual stream, so no neuron writes to it alone."
        )
    for name, value in (("max_nodes", max_nodes), ("max_logits", max_logits)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgumentError(f"Expected {name} to be a positive integer. Got {value!r}.")
    if rows is not None and (not isinstance(rows, int) or rows < 1):
        raise InvalidArgumentError(f"Expected rows_per_pass to be a positive integer. Got {rows!r}.")
    if not 0.0 < probability <= 1.0:
        raise InvalidArgumentError(f"Expected a logit probability in (0, 1]. Got {probability!r}.")
    engine.check_neurons()


def _rows_per_pass(engine: Engine, n: int, max_nodes: int, max_logits: int, acts: dict[int, torch.Tensor],
                   rows: int | None) -> int:
    """Adjacency rows per pass, counted with everything else the graph holds against the memory budget: the
    engine's own needs (:meth:`~detjac.engine.Engine.sweep_memory`: a layer read in, the trace), every layer's
    neuron values and MLP output, the chosen neurons' read and write rows, the adjacency (float64, square in the
    nodes, on the CPU) and each row's cotangents while it crosses a layer. ``rows`` (the caller's) if given, else all
    the budget holds (at most one pass for every row), else :data:`ROWS_PER_PASS` without a budget. Refuses, before
    any pullback, a ``max_nodes`` whose graph the budget cannot hold beside one row."""
    from ..memory import device_key

    left, per_row = engine.sweep_memory(n)
    itemsize, d = engine.dtype.itemsize, engine.d_model
    per_row += 2 * n * d * itemsize  # the adjacency's products of a row's cotangents
    values = sum(z.numel() for z in acts.values()) * itemsize
    held = values + len(acts) * n * d * itemsize + 2 * max_nodes * d * itemsize  # + ranking's scores, transient
    size = max_nodes + n + max_logits
    adjacency = size * size * 8
    device = device_key(engine.device)
    if device != "cpu":  # the adjacency is the CPU's, the rest the device's
        cpu = engine.memory_budget("cpu")
        if cpu is not None and adjacency > cpu:
            _refuse_nodes(max_nodes, n, max_logits, cpu, 0, f"the CPU budget ({cpu / 2**20:.0f} MiB)")
        adjacency = 0
    if left is None:
        return rows or ROWS_PER_PASS
    fixed = max(held + adjacency, 3 * values)  # ranking holds the values, their scores and a flat copy
    if fixed + per_row > left:
        if values + per_row > left:
            raise InvalidArgumentError(
                f"Expected a memory budget that holds the graph's neuron values beside one adjacency row at {n} "
                f"tokens ({(values + per_row) / 2**20:.0f} MiB on {device}). Got {left / 2**20:.0f} MiB left once "
                f"the engine's layer and trace are counted."
            )
        _refuse_nodes(max_nodes, n, max_logits, left, held - 2 * max_nodes * d * itemsize + per_row,
                      f"the {device} budget left once the engine's layer and trace are counted "
                      f"({left / 2**20:.0f} MiB)")
    return rows or max(1, min((left - fixed) // per_row, max_nodes + max_logits))


def _refuse_nodes(max_nodes: int, n: int, max_logits: int, budget: int, beside: int, where: str) -> None:
    """Refuse ``max_nodes``, naming how many fit in ``budget`` bytes beside ``beside`` bytes of the rest."""
    size = max_nodes + n + max_logits
    fits = max(int((max(budget - beside, 0) / 8) ** 0.5) - n - max_logits, 0)
    raise InvalidArgumentError(
        f"Expected a --max-nodes whose adjacency fits in {where} beside the rest of the graph "
        f"({beside / 2**20:.0f} MiB: neuron values, MLP outputs, one row). Got {max_nodes}: {size} nodes take "
        f"{size * size * 8 / 2**20:.0f} MiB; at most {fits} fit."
    )


@dataclass
class _Targets:
    ids: list[int]
    probabilities: np.ndarray  # (K,)
    vectors: torch.Tensor  # (K, d): value_k = vectors[k] @ y
    values: torch.Tensor  # (K,)


def logit_vectors(engine: Engine, y: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """(K, d) the vectors ``w_t`` with ``w_t · y`` the demeaned logit of each token of ``ids`` (see
    :func:`_logit_targets`)."""
    return _logit_targets(engine, y, len(ids), 1.0, ids).vectors


def _logit_targets(engine: Engine, y: torch.Tensor, max_logits: int, probability: float,
                   ids: list[int] | None = None) -> _Targets:
    """The top logits until ``probability`` (at most ``max_logits``), each as a vector ``w`` with ``w · y`` its
    demeaned logit: ``r_t W_U[t] - mean_v r_v W_U[v]``, ``r`` the final soft-cap's frozen ratio (1 without one)."""
    W = engine.decoding_matrices()["unembedding"].to(device=y.device, dtype=y.dtype)  # (V, d)
    with torch.no_grad():
        raw = W @ y
        logits = engine.logits(y).to(y.dtype)
        ratio = torch.where(raw != 0, logits / torch.where(raw != 0, raw, torch.ones_like(raw)), torch.ones_like(raw))
        probs = torch.softmax(logits.double(), dim=-1)
        if ids is None:
            top = torch.sort(probs, descending=True)
            k = int(torch.searchsorted(top.values.cumsum(0), torch.tensor(probability, dtype=torch.float64))) + 1
            chosen = top.indices[:min(k, max_logits)]
        else:
            chosen = torch.as_tensor(ids, dtype=torch.long, device=y.device)
        mean = (ratio @ W) / W.shape[0]  # (d,) the mean over the vocabulary, never a (V, d) temporary
        vectors = ratio[chosen, None] * W[chosen] - mean
    return _Targets([int(i) for i in chosen], probs[chosen].cpu().numpy(), vectors, vectors @ y)


def logit_attribution(engine: Engine, trace: Any, vectors: torch.Tensor, acts: dict[int, torch.Tensor] | None = None
                      ) -> Iterator[tuple[int, torch.Tensor]]:
    """Every neuron's total attribution to the logits ``vectors`` (K, d) (``value_k = vectors[k] · y``):
    ``(layer, (K, n, n_neurons) act · ∂value_k/∂act)`` through every path of the detached model (nothing cut), one
    layer at a time, from one pullback. By linearity, zeroing a set of neurons changes ``value_k`` by minus the sum
    of their attributions in the detached model (what the graphs' faithfulness is measured against)."""
    acts = acts if acts is not None else {layer: z for layer, z, _ in engine.neurons(trace)}
    reads = tuple(neurons_of(layer) for layer in range(engine.n_layers))
    for _, site, g in engine.pulls(trace, [PullRequest((Seed(OUTPUT, vectors),), reads)]):
        yield site.layer, g * acts[site.layer][None]


def _rank(engine: Engine, trace: Any, targets: _Targets, acts: dict[int, torch.Tensor], max_nodes: int
          ) -> tuple[torch.Tensor, int]:
    """The ``max_nodes`` neurons with the largest total attribution to the logits (``sum_k p_k |act ·
    ∂logit_k/∂act| / |logit_k|``, through every path), as (M, 3) (layer, index, position) sorted by layer,
    position, index; and how many were active (nonzero, at or before the position)."""
    p = trace.position
    weights = torch.as_tensor(targets.probabilities, dtype=targets.values.dtype, device=targets.values.device)
    weights = weights / targets.values.abs().clamp_min(torch.finfo(targets.values.dtype).tiny)
    scores: dict[int, torch.Tensor] = {}
    for layer, attr in logit_attribution(engine, trace, targets.vectors, acts):
        scores[layer] = torch.einsum("k,knf->nf", weights, attr.abs())[:p + 1]
    flat = torch.cat([scores[layer].reshape(-1) for layer in range(engine.n_layers)])
    active = torch.cat([acts[layer][:p + 1].ne(0).reshape(-1) for layer in range(engine.n_layers)])
    flat = torch.where(active, flat, torch.full_like(flat, -1.0))
    n_active = int(active.sum())
    keep = torch.topk(flat, min(max_nodes, n_active)).indices if n_active else flat.new_zeros(0, dtype=torch.long)
    width = torch.tensor([scores[layer].numel() for layer in range(engine.n_layers)])
    starts = torch.cumsum(width, 0) - width
    layer = torch.searchsorted(starts, keep.cpu(), right=True) - 1
    within = keep.cpu() - starts[layer]
    n_neurons = torch.tensor([acts[layer_].shape[1] for layer_ in range(engine.n_layers)])
    pos, index = within // n_neurons[layer], within % n_neurons[layer]
    chosen = torch.stack([layer, index, pos], dim=1)
    order = np.lexsort((chosen[:, 1].numpy(), chosen[:, 2].numpy(), chosen[:, 0].numpy()))
    return chosen[torch.as_tensor(order, dtype=torch.long)], n_active


def _chosen_values(acts: dict[int, torch.Tensor], chosen: torch.Tensor) -> torch.Tensor:
    if chosen.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack([acts[int(layer)][int(pos), int(index)] for layer, index, pos in chosen.tolist()])


@dataclass
class _Sites:
    """What the adjacency needs of each layer's chosen neurons: their read and write rows (m, d) and the MLP's
    output (n, d) on the prompt (for the sum over every neuron of the layer); for an affine family, each layer's
    constants with its neurons held (n, d) and each chosen neuron's value on a zero layer input (M,)."""

    reads: dict[int, torch.Tensor]
    writes: dict[int, torch.Tensor]
    outputs: dict[int, torch.Tensor]
    labels: list[str]
    layer_bias: dict[int, torch.Tensor] = field(default_factory=dict)
    neuron_bias: torch.Tensor | None = None


def _sites(engine: Engine, trace: Any, chosen: torch.Tensor, acts: dict[int, torch.Tensor]) -> _Sites:
    """One pass over the layers: each chosen neuron's read and write rows and label, each layer's MLP output (and
    an affine family's constants)."""
    mats = engine.decoding_matrices(torch.float32)
    W_U, W_E = mats["unembedding"], mats["embedding"]
    reads, writes, outputs, layer_bias = {}, {}, {}, {}
    labels: dict[int, str] = {}
    affine = bool(engine.family.affine)
    neuron_bias = torch.zeros(chosen.shape[0], dtype=engine.dtype) if affine else None
    for layer, _, mlp in engine.neurons(trace):
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
        out_dirs = writes[layer].float().cpu()
        in_dirs = reads[layer].float().cpu()
        for c0 in range(0, rows.numel(), 64):
            out_top = torch.topk(out_dirs[c0:c0 + 64] @ W_U.T, 4 * LABEL_TOKENS, dim=1).indices
            in_top = torch.topk(in_dirs[c0:c0 + 64] @ W_E.T, 4 * LABEL_TOKENS, dim=1).indices
            for r, o, i in zip(rows[c0:c0 + 64].tolist(), out_top.tolist(), in_top.tolist(), strict=True):
                labels[r] = f"writes {_readable(engine, o)} · reads {_readable(engine, i)}"
    return _Sites(reads, writes, outputs, [labels[r] for r in range(chosen.shape[0])], layer_bias, neuron_bias)


def _bias_nodes(engine: Engine, n: int, position: int) -> np.ndarray:
    """(B, 2) the bias nodes' (layer, position): every layer at every position, then the final norm's at the
    predicted position; none for a linear family."""
    if not engine.family.affine:
        return np.zeros((0, 2), dtype=np.int64)
    L = engine.n_layers
    grid = np.stack(np.meshgrid(np.arange(L), np.arange(n), indexing="ij"), axis=-1).reshape(-1, 2)
    return np.concatenate([grid, [[L, position]]]).astype(np.int64)


@dataclass(frozen=True)
class _Layout:
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

    def receiving(self, rows: np.ndarray) -> np.ndarray:
        """Adjacency rows (neurons, logits) -> positions in the (M + K,) per-receiving-node arrays."""
        return np.where(rows < self.M, rows, rows - self.B - self.n)


def _adjacency(engine: Engine, trace: Any, targets: _Targets, acts: dict[int, torch.Tensor], chosen: torch.Tensor,
               sites: _Sites, rows_per_pass: int, progress: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(adjacency, completeness, kept share): one cut pullback per logit and per chosen neuron, read at every layer's
    output (= its MLP's output, the MLPs being cut), at the embeddings, and for an affine family at the first
    layer's input (the constants before it)."""
    n, L = trace.n_tokens, engine.n_layers
    affine = bool(sites.layer_bias)
    at = _Layout(chosen.shape[0], (L * n + 1) if affine else 0, n, len(targets.ids))
    A = np.zeros((at.size, at.size))
    total = np.zeros(at.M + at.K)  # each receiving node's incoming edges over every source of the model
    columns = {layer: (chosen[:, 0] == layer).nonzero().reshape(-1) for layer in range(L)}
    values = _chosen_values(acts, chosen)
    x = trace.embeddings
    first, last = engine.residual_ends(trace) if affine else (None, None)
    positions = np.arange(n)

    def add(rows: np.ndarray, cols: np.ndarray | int, edges: torch.Tensor) -> None:
        """Edges (rows, cols) into the adjacency and every receiving node's total."""
        e = edges.cpu().double().numpy().reshape(len(rows), -1)
        A[np.ix_(rows, np.atleast_1d(cols))] += e
        total[at.receiving(rows)] += e.sum(1)

    passes = _passes(chosen, targets, sites, rows_per_pass, n, L, affine)
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
    all_values = np.concatenate([values.cpu().double().numpy(), targets.values.cpu().double().numpy()])
    scale = np.maximum(np.abs(all_values), np.finfo(np.float64).tiny)
    completeness = np.abs(total - all_values) / scale
    receiving = np.r_[np.arange(at.M), at.logits + np.arange(at.K)]
    kept_share = A[receiving].sum(1) / np.where(all_values != 0, all_values, 1.0)
    return A, completeness, kept_share


def _passes(chosen: torch.Tensor, targets: _Targets, sites: _Sites, rows_per_pass: int, n: int, L: int,
            affine: bool) -> list[tuple[list[PullRequest], list[np.ndarray]]]:
    """The cut pullbacks, grouped into passes of at most ``rows_per_pass`` rows: the logits first (seeded at the
    output), then the chosen neurons a layer at a time (seeded with their read rows at the layer's mid residual,
    reading the outputs of the layers below; an affine family's also the first layer's input)."""
    M, K = chosen.shape[0], len(targets.ids)
    at = _Layout(M, (L * n + 1) if affine else 0, n, K)
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


def _readable(engine: Engine, ids: list[int]) -> str:
    """The first :data:`LABEL_TOKENS` of ``ids`` whose text is whole (not a fragment of a multi-byte character),
    quoted; the first ones whatever they are when none is."""
    texts = token_texts(engine, ids)
    whole = [t for t in texts if t.strip() and t.isprintable() and "\ufffd" not in t] or texts
    return " ".join(repr(t) for t in whole[:LABEL_TOKENS])
