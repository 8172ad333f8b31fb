"""Exact attribution graphs of one prediction: input tokens, MLP neurons and top logits, with no transcoder and no
error nodes.

With attention probabilities, norm scales and every MLP's gate frozen, each MLP neuron ``z = gate · (W_up norm(r))``
is linear in the residual stream, and the model is linear in the input embeddings and the neurons. An edge
``a -> b`` is ``act(a) · ∂value(b)/∂act(a)`` with every MLP's output held at its neurons (the direct effect), so each
node's incoming edges over all sources sum to its value exactly.

:func:`build_graph` computes the graph from the prompt's one trace in phases that read top-down: the logit targets,
the neurons ranked by one pullback per logit, the rows per pass the memory budget holds, the adjacency (one cut
pullback per kept node, with the engine's pullback primitive), the completeness of every node's edges, the pruning,
with ``heads`` the strongest pruned links split by attention head (:mod:`detjac.graphs.head_loadings`), and with
``qk`` the asked heads' QK attribution (:mod:`detjac.graphs.qk_records`).
:func:`attribution_graph` is the verb (one prompt pass, :func:`detjac.engine.prompt_pass`, with :func:`graph_step`);
``detjac graph`` and ``detjac run --graph`` both build through :func:`graph_step`. Definitions: docs/graphs.md."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from detjac.engine import Engine, FrozenValues, Trace, activations, check_neurons, prompt_pass
from detjac.errors import UnsupportedModelError
from detjac.graph_settings import GraphSettings, parse_target
from detjac.tokens import token_labels

from .adjacency import Layout, adjacency, bias_nodes, completeness, neuron_sites, sized_rows
from .head_effects import head_effects
from .head_loadings import HeadLoadings, Nodes, choose_links, head_loadings
from .prune import Pruned, prune
from .qk_records import check_qk, qk_phase
from .targets import (
    chosen_values,
    graph_targets,
    logit_attribution,
    logit_vectors,
    rank_neurons,
    token_id,
)

__all__ = ["AttributionGraph", "attribution_graph", "build_graph", "check_graph", "graph_step", "logit_attribution",
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
        (K,) each target's value: its demeaned logit ``logit_t - mean_v logit_v``, or for a contrast
        (``target``) ``logit_t - logit_minus``; the logit node's value.
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
    target : str or None
        The asked target as written back (``' Paris' - ' London'``; :func:`~detjac.graph_settings.parse_target`),
        None for the top logits; ``minus_id`` and ``minus_token`` a contrast's second token.
    aside : tuple of int
        The positions set aside (``(0,)`` with ``aside_first``): every value of the graph is that system's.
    token_contributions : numpy.ndarray
        (K, n) each token's exact signed contribution to each logit node's value (through every path); what they
        leave of the value is an affine family's constants' (:attr:`constants_contribution`).
    head_loadings : HeadLoadings or None
        With ``heads`` asked for: the loadings of the strongest links of the graph pruned at ``pruned_at``.
    pruned : Pruned or None
        The pruning at ``pruned_at`` (node, edge thresholds) that the loaded links were chosen in; the JSON reuses it.
    qk : list
        With ``qk`` asked for: each head's QK attribution at the position
        (:class:`~detjac.engine.tools.qk.QKAttribution`), which the JSON carries as QK records.
    head_effects : numpy.ndarray
        (K, n_layers, n_heads) every head's exact direct effect on each logit node's value
        (:func:`~detjac.graphs.head_effects.head_effects`).
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
    target: str | None = None
    minus_id: int | None = None
    minus_token: str | None = None
    aside: tuple[int, ...] = ()
    token_contributions: np.ndarray | None = None
    head_loadings: HeadLoadings | None = None
    pruned: Pruned | None = None
    pruned_at: tuple[float, float] | None = None
    qk: list[Any] = field(default_factory=list)
    head_effects: np.ndarray | None = None

    @property
    def layout(self) -> Layout:
        """Where each node kind sits in the adjacency (neurons, bias nodes, tokens, logits)."""
        return Layout(self.n_neurons, self.n_biases, self.n_tokens, self.n_logits)

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
    def target_names(self) -> list[str]:
        """(K,) what each logit node explains, as the command line says it: the asked target (``' Paris' - ' the'``)
        or each token (``' Paris'``)."""
        return [self.target] if self.target is not None else [repr(t) for t in self.logit_tokens]

    @property
    def constants_contribution(self) -> np.ndarray:
        """(K,) what the constants (an affine family's bias nodes) contribute to each logit node's value: the value
        less its tokens' contributions (0 within rounding for a linear family)."""
        return self.logit_values - np.asarray(self.token_contributions).sum(1)

    @property
    def worst_completeness(self) -> float:
        """The largest relative error of a node's incoming edges against its value (0: exact)."""
        return float(self.completeness.max()) if self.completeness.size else 0.0

    def __repr__(self) -> str:
        biases = f", {self.n_biases} bias nodes" if self.n_biases else ""
        return (f"<AttributionGraph {self.n_tokens} tokens, {self.n_neurons} of {self.n_active} active neurons"
                f"{biases}, {self.n_logits} logits; completeness {self.worst_completeness:.1e}>")


def build_graph(engine: Engine, trace: Trace, settings: GraphSettings, progress: bool = False) -> AttributionGraph:
    """The exact attribution graph of the prediction at ``trace``'s position (see the module docstring), from the
    engine's trace of the prompt, in its phases; the settings checked before the trace by :func:`check_graph`."""
    n, p = trace.n_tokens, trace.position
    # 0. the system: the prompt's frozen one, or the same with the first position set aside (its values recomputed)
    system = FrozenValues.first_aside(engine, trace) if settings.aside_first else None
    acts = dict(activations(engine, trace)) if system is None else system.neurons  # (n, neurons) per layer
    x = trace.embeddings if system is None else system.embeddings
    # 1. targets: the top logits or the asked one, each a vector whose product with the output is its value
    targets = graph_targets(engine, trace.output, trace.output if system is None else system.output, settings)
    # 2. rank: one pullback per logit scores every neuron (the max_nodes strongest enter the adjacency) and gives
    #    every token's signed contribution to it
    chosen, n_active, contributions = rank_neurons(engine, trace, targets, acts, settings.max_nodes, x)
    values = chosen_values(acts, chosen)
    # 3. rows: the adjacency rows pulled back per pass that the memory budget holds (refused here if none fit)
    rows = sized_rows(engine, n, settings.max_nodes, len(targets.ids), acts, settings.rows_per_pass)
    # 4. adjacency: the kept neurons' read and write rows, then one cut pullback per logit and per kept neuron
    sites = neuron_sites(engine, trace, chosen, acts)
    if system is not None:  # the constants added at a position set aside go with it
        sites.layer_bias = {layer: _aside(bias, system.aside) for layer, bias in sites.layer_bias.items()}
    A, totals = adjacency(engine, trace, targets, acts, chosen, sites, rows, progress, system)
    # 5. completeness: every receiving node's edges over all sources against its value
    logit_values = targets.values.cpu().double().numpy()
    received = np.concatenate([values.cpu().double().numpy(), logit_values])
    complete, kept_share = completeness(A, totals, received, len(targets.ids))
    ids = list(trace.token_ids)
    graph = AttributionGraph(
        token_ids=ids, tokens=token_labels(engine.tokenizer, ids), position=p, n_layers=engine.n_layers,
        logit_ids=targets.ids, logit_tokens=token_labels(engine.tokenizer, targets.ids),
        logit_probabilities=targets.probabilities, logit_values=logit_values, neurons=chosen.cpu().numpy(),
        activations=values.cpu().double().numpy(), adjacency=A, completeness=complete, kept_share=kept_share,
        n_active=n_active, labels=sites.labels, biases=bias_nodes(engine, n, p), info=_info(engine, acts, settings),
        target=targets.text, minus_id=targets.minus, aside=system.aside if system is not None else (),
        minus_token=token_labels(engine.tokenizer, [targets.minus])[0] if targets.minus is not None else None,
        token_contributions=contributions.cpu().double().numpy())
    # 6. prune: the nodes and edges carrying the logits (the JSON reuses it at the same thresholds)
    graph.pruned_at = (settings.node_threshold, settings.edge_threshold)
    graph.pruned = prune(A, graph.n_neurons, n, graph.logit_probabilities, *graph.pruned_at)
    # 7. head loadings: the strongest pruned links split by attention head
    if settings.heads:
        links = choose_links(A, graph.pruned, graph.n_neurons, graph.n_biases, n, settings.heads,
                             settings.heads_up_to, settings.heads_into)
        nodes = Nodes(graph.n_neurons, graph.n_biases, n, chosen, values, sites.reads, sites.writes,
                      targets.vectors, x)
        held = A.nbytes + sum(z.numel() for z in acts.values()) * engine.dtype.itemsize
        started = time.perf_counter()
        graph.head_loadings = head_loadings(engine, trace, nodes, links, A[links[:, 0], links[:, 1]], held)
        graph.info.update(heads=len(links), head_loadings_error=graph.head_loadings.error,
                          head_loadings_seconds=round(time.perf_counter() - started, 3))
    # 8. QK records: the asked heads' exact QK attribution at the position
    graph.qk = qk_phase(engine, ids, p, settings.qk)
    # 9. direct effects: every head's output at the position against each logit's cotangent leaving the last layer
    #    (no time recorded: a graph's JSON is the same whenever it is computed, what stores and resumed runs compare)
    inputs = None if system is None else dict(enumerate(system.inputs[:-1]))  # that system's, where set aside
    graph.head_effects = head_effects(engine, trace, targets.vectors, inputs)
    return graph


def _aside(bias: Any, positions: tuple[int, ...]) -> Any:
    """A layer's constants (n, d) with those at ``positions`` removed."""
    bias = bias.clone()
    bias[list(positions)] = 0
    return bias


def _info(engine: Engine, acts: dict[int, Any], settings: GraphSettings) -> dict[str, Any]:
    """What a graph records of its model, engine and settings (its JSON's ``metadata.info``)."""
    return {"family": engine.family.name, "model_type": engine.config.model_type,
            "dtype": str(engine.dtype).removeprefix("torch."), "n_layers": engine.n_layers,
            "n_heads": int(getattr(engine.config.get_text_config(), "num_attention_heads", 0)),
            "d_model": engine.d_model, "neurons_per_layer": int(next(iter(acts.values())).shape[1]),
            "max_nodes": settings.max_nodes, "engine": type(engine).__name__}


def graph_step(engine: Engine, settings: GraphSettings, progress: bool = False) -> Callable[[Trace], AttributionGraph]:
    """The graph step of a prompt pass (:func:`detjac.engine.prompt_pass`'s ``graph``): :func:`build_graph` of the
    pass's trace, ``settings`` checked now (:func:`check_graph`), before any trace or store is touched. ``detjac
    graph`` (through :func:`attribution_graph`) and ``detjac run --graph`` both build their graphs with it."""
    check_graph(engine, settings)
    return lambda trace: build_graph(engine, trace, settings, progress)


def attribution_graph(engine: Engine, prompt: str | Sequence[int], settings: GraphSettings | None = None, *,
                      progress: bool = False) -> AttributionGraph:
    """The exact attribution graph of the prediction at the prompt's last position (see the module docstring).

    Parameters
    ----------
    engine
        Any engine with neuron sites (:attr:`~detjac.engine.Engine.pullback_sites`): explicit detached sweeps.
    prompt
        Text or token ids.
    settings
        What the graph is computed with (:class:`~detjac.graph_settings.GraphSettings`: neurons ranked into the
        adjacency, logit targets, rows per pass, links split by attention head and the pruning they are chosen in);
        None: circuit-tracer's defaults.
    progress
        Show a progress bar.

    Raises
    ------
    UnsupportedModelError
        A family whose neurons have no definition here (post-norm layers; an MLP not known as one).
    InvalidArgumentError
        Settings out of range (before any work), an engine without neuron sites (autograd sweeps, ordinary
        Jacobian), a ``max_nodes`` the memory budget cannot hold, or more ``heads`` than the pruned graph's links
        (before any is loaded).
    PromptError
        An empty prompt, unknown ids, or more tokens than the model's context.
    """
    step = graph_step(engine, settings or GraphSettings(), progress)
    graph = prompt_pass(engine, prompt, [], graph=step, progress=progress).graph
    assert graph is not None  # asked for
    return graph


def check_graph(engine: Engine, settings: GraphSettings) -> None:
    """Raise, before any work, what :func:`build_graph` would raise for ``engine`` and ``settings`` whatever the
    prompt (``detjac run --graph`` checks it before a store is touched).

    Raises
    ------
    UnsupportedModelError
        A family whose neurons have no definition here.
    InvalidArgumentError
        Settings out of range (:meth:`~detjac.graph_settings.GraphSettings.check`), an engine without neuron
        sites, a target token that is not one token of the vocabulary, or ``aside_first`` on an engine without the
        whole model in memory (the layer-streamed one).
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
    check_qk(engine, settings.qk)
    if settings.target is not None:
        asked = parse_target(settings.target)
        for text in (asked.plus, asked.minus):
            if text is not None:
                token_id(engine, text)
    if settings.aside_first:
        FrozenValues.check(engine)
