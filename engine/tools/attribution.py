"""Exact attribution graphs of one prediction: input tokens, MLP neurons and top logits, with no transcoder and no
error nodes.

With attention probabilities, norm scales and every MLP's gate frozen, each MLP neuron ``z = gate · (W_up norm(r))``
is linear in the residual stream, and the model is linear in the input embeddings and the neurons. An edge
``a -> b`` is ``act(a) · ∂value(b)/∂act(a)`` with every MLP's output held at its neurons (the direct effect), so each
node's incoming edges over all sources sum to its value exactly. :func:`graph_of_trace` computes the graph from the
prompt's one trace (:func:`detjac.engine.prompt_pass` calls it; :func:`detjac.engine.attribution_graph` is the verb)
with the pullback primitive (:mod:`detjac.engine.pullback`): one pullback per logit ranks every neuron, then one cut
pullback per kept node gives its row of the adjacency; with ``heads``, the strongest links of the pruned graph are
split by attention head (:mod:`detjac.engine.tools.head_loadings`). Definitions: docs/graphs.md."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from detjac.errors import UnsupportedModelError
from detjac.graph_settings import GraphSettings
from detjac.tokens import token_labels

from ..interface import Engine
from ..types import Trace
from .graph_adjacency import adjacency, bias_nodes, neuron_sites, sized_rows
from .graph_prune import Pruned, prune
from .graph_targets import (
    chosen_values,
    logit_attribution,
    logit_targets,
    logit_vectors,
    rank_neurons,
)
from .head_loadings import HeadLoadings, Nodes, choose_links, head_loadings
from .neurons import activations, check_neurons

__all__ = ["AttributionGraph", "check_graph", "graph_of_trace", "logit_attribution",
           "logit_vectors"]


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
    head_loadings : HeadLoadings or None
        With ``heads`` asked for: the loadings of the strongest links of the graph pruned at ``pruned_at``.
    pruned : Pruned or None
        The pruning the loaded links were chosen in, at ``pruned_at`` (node, edge thresholds); the JSON reuses it.
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
    head_loadings: HeadLoadings | None = None
    pruned: Pruned | None = None
    pruned_at: tuple[float, float] | None = None

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


def graph_of_trace(engine: Engine, trace: Trace, request: GraphSettings, progress: bool = False) -> AttributionGraph:
    """The exact attribution graph of the prediction at ``trace``'s position (see the module docstring), from the
    engine's trace of the prompt; the settings checked before the trace by :func:`check_graph`."""
    max_nodes, max_logits = request.max_nodes, request.max_logits
    n, p = trace.n_tokens, trace.position
    acts = dict(activations(engine, trace))
    rows = sized_rows(engine, n, max_nodes, max_logits, acts, request.rows_per_pass)
    targets = logit_targets(engine, trace.output, max_logits, request.logit_probability)
    chosen, n_active = rank_neurons(engine, trace, targets, acts, max_nodes)
    sites = neuron_sites(engine, trace, chosen, acts)
    graph = adjacency(engine, trace, targets, acts, chosen, sites, rows, progress)
    ids = list(trace.token_ids)
    graph_labels = sites.labels
    out = AttributionGraph(
        token_ids=ids, tokens=token_labels(engine.tokenizer, ids), position=p, n_layers=engine.n_layers,
        logit_ids=targets.ids, logit_tokens=token_labels(engine.tokenizer, targets.ids),
        logit_probabilities=targets.probabilities, logit_values=targets.values.cpu().double().numpy(),
        neurons=chosen.cpu().numpy(), activations=chosen_values(acts, chosen).cpu().double().numpy(),
        adjacency=graph[0], completeness=graph[1], kept_share=graph[2], n_active=n_active, labels=graph_labels,
        biases=bias_nodes(engine, n, p),
        info={"family": engine.family.name, "model_type": engine.config.model_type,
              "dtype": str(engine.dtype).removeprefix("torch."), "n_layers": engine.n_layers,
              "n_heads": int(getattr(engine.config.get_text_config(), "num_attention_heads", 0)),
              "d_model": engine.d_model, "neurons_per_layer": int(next(iter(acts.values())).shape[1]),
              "max_nodes": max_nodes, "engine": type(engine).__name__},
    )
    if request.heads:
        out.pruned_at = (request.node_threshold, request.edge_threshold)
        out.pruned = prune(out.adjacency, out.n_neurons, n, out.logit_probabilities, *out.pruned_at)
        links = choose_links(out.adjacency, out.pruned, out.n_neurons, out.n_biases, n, request.heads,
                             request.heads_up_to, request.heads_into)
        nodes = Nodes(out.n_neurons, out.n_biases, n, chosen, chosen_values(acts, chosen), sites.reads, sites.writes,
                      targets.vectors, trace.embeddings)
        held = out.adjacency.nbytes + sum(z.numel() for z in acts.values()) * engine.dtype.itemsize
        started = time.perf_counter()
        out.head_loadings = head_loadings(engine, trace, nodes, links, out.adjacency[links[:, 0], links[:, 1]], held)
        out.info.update(heads=len(links), head_loadings_error=out.head_loadings.error,
                        head_loadings_seconds=round(time.perf_counter() - started, 3))
    return out


def check_graph(engine: Engine, settings: GraphSettings) -> None:
    """Raise, before any work, what :func:`graph_of_trace` would raise for ``engine`` and ``settings`` whatever the
    prompt (``detjac run --graph`` checks it before a store is touched).

    Raises
    ------
    UnsupportedModelError
        A family whose neurons have no definition here.
    InvalidArgumentError
        Settings out of range (:meth:`~detjac.graph_settings.GraphSettings.check`), or an engine without neuron
        sites.
    """
    family = engine.family
    if family.post_norm:
        raise UnsupportedModelError(
            f"Expected a family whose MLP neurons detjac defines for attribution graphs (pre-norm layers: an MLP "
            f"reading a normed copy of the residual stream). Got {family.name}: post-norm layers, whose MLP output "
            "is normed together with the residual stream, so no neuron writes to it alone."
        )
    settings.check()
    check_neurons(engine)
