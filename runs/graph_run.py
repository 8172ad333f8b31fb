"""An attribution graph from a model to its JSON, once for ``detjac graph`` (:func:`graph_file`: identity, neuron
index, engine, graph, labels, groups, file) and ``detjac run --graph`` (:func:`graph_json`: a prompt's graph as its
store keeps it): both build the graph with the graphs layer's one step (:func:`detjac.graphs.graph_step`, inside a
prompt pass) and write it through :func:`graph_document`.

Both record the same model digests in the graph's ``metadata.info`` (:func:`graph_identity`), so a graph written by
either names the weights it was computed from; a neuron index is refused, by name, before the model loads unless it
was made with the same model and detach convention."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .fingerprint import model_identity

if TYPE_CHECKING:
    from detjac.engine import Engine, ModelRef
    from detjac.graph_settings import GraphSettings
    from detjac.graphs import AttributionGraph
    from detjac.model_settings import LoadSpec
    from detjac.store import NeuronIndex

    from .description import RunDescription

GRAPH_IDENTITY = ("config_sha256", "weights_sha256", "tokenizer_sha256")  # a graph's metadata.info names them


@dataclass
class GraphOutcome:
    """What :func:`graph_file` computed and wrote: the graph, its JSON as written, and how it was labelled."""

    graph: AttributionGraph
    data: dict[str, Any]  # the written JSON
    seconds: float  # from the engine's first pass to the file
    index: NeuronIndex | None = None  # the neuron index the labels came from
    groups: tuple[str, str] | None = None  # with groups: how many neurons they hold, and how exact they are
    heads: list[str] = field(default_factory=list)  # with head loadings: the heads carrying the top logit
    engine: Engine | None = None  # the engine the graph was computed with (its attention pages reuse it)


def graph_identity(described: Mapping[str, Any]) -> dict[str, str]:
    """The model digests (:data:`GRAPH_IDENTITY`) of a run description or a
    :func:`~detjac.runs.fingerprint.model_identity` that a graph's ``metadata.info`` records."""
    return {key: described[key] for key in GRAPH_IDENTITY if isinstance(described.get(key), str)}


def graph_document(graph: AttributionGraph, *, slug: str, model: str, settings: GraphSettings,
                   identity: Mapping[str, Any], supernodes: Sequence[tuple[str, Sequence[int]]] = ()) -> dict[str, Any]:
    """A graph as circuit-tracer's JSON object (:func:`detjac.graphs.graph_dict`), pruned at ``settings``'
    thresholds, its ``metadata.info`` naming the model's digests found in ``identity`` (:func:`graph_identity`):
    what ``detjac graph`` writes and a ``--graph`` run stores."""
    from detjac.graphs import graph_dict

    return graph_dict(graph, slug=slug, model=model, node_threshold=settings.node_threshold,
                      edge_threshold=settings.edge_threshold, identity=graph_identity(identity), supernodes=supernodes)


def graph_json(graph: AttributionGraph, pid: str, run: RunDescription) -> dict[str, Any]:
    """The prompt's attribution graph as a ``--graph`` run stores it (:func:`graph_document`): the prompt id as its
    slug, the run's ``model_id`` as its model, the run's graph settings and model digests."""
    assert run.graph is not None  # a --graph run's prompt
    return graph_document(graph, slug=pid, model=run.model_id, settings=run.graph, identity=run.as_dict())


def graph_file(model: ModelRef, prompt: str, loading: LoadSpec, out: str | Path, settings: GraphSettings, *,
               slug: str | None = None, neuron_index: str | Path | None = None, group: bool = False,
               force: bool = False, progress: bool = True) -> GraphOutcome:
    """The exact attribution graph of ``model``'s prediction on ``prompt``, written as circuit-tracer's graph JSON
    to ``out`` (``graph-metadata.json`` updated beside it).

    Parameters
    ----------
    model : ModelRef
        The model, resolved.
    prompt : str
    loading : LoadSpec
        How the model loads (dtype, device, streamed, memory budget, detach convention).
    out : str or Path
        A new .json file (or one ``force`` replaces).
    settings : GraphSettings
        What the graph is computed with; its thresholds prune the written JSON.
    slug : str or None
        The graph's name in the frontend (default: ``out``'s stem).
    neuron_index : path or None
        A neuron index of this model (``detjac neurons``): each neuron's label becomes its top contexts' tokens.
    group : bool
        With ``neuron_index``: group the neurons of a layer whose pages agree into supernodes.
    force : bool
        Replace ``out``.
    progress : bool
        Show the engine's progress bar.

    Returns
    -------
    GraphOutcome

    Raises
    ------
    InvalidArgumentError
        ``group`` without ``neuron_index``.
    StoreMismatchError
        A neuron index made with another model, detach convention or model shape.
    """
    import time

    from detjac.errors import InvalidArgumentError
    from detjac.graph_index import slug_of, write_graph_file
    from detjac.graphs import attribution_graph
    from detjac.outputs import check_output

    if group and not neuron_index:
        raise InvalidArgumentError("Expected --group with --neurons (a group is made of neurons whose pages agree). "
                                   "Got --group alone.")
    reads = [("the model", model.source), *([("the neuron index", neuron_index)] if neuron_index else [])]
    path = check_output(out, force=force, suffix=".json", reads=reads)  # before any work, as the command checks it
    identity = model_identity(model.source)  # the weights' SHA-256, as a store's run records it
    index = _neuron_index(neuron_index, identity, loading.convention) if neuron_index else None
    engine = _load(replace(loading, model=model))
    started = time.perf_counter()
    g = attribution_graph(engine, prompt, settings, progress=progress)
    if index is not None:
        from detjac.analysis import relabel

        # the model's shape, known once traced: compared whether or not the index or the model has a digest
        index.check({k: g.info.get(k) for k in ("family", "n_layers", "neurons_per_layer")})
        g.labels = relabel(g.labels, g.neurons, index, activations=g.activations)
    supernodes, grouping = _groups(g, index) if group and index is not None else ([], None)
    data = graph_document(g, slug=slug or slug_of(path), model=model.name, settings=settings, identity=identity,
                          supernodes=supernodes)
    write_graph_file(path, data)  # graph-metadata.json beside it lists it
    heads = heads_into_top_logit(g) if g.head_loadings is not None else []
    return GraphOutcome(g, data, time.perf_counter() - started, index, grouping, heads, engine)


def _load(loading: LoadSpec) -> Engine:
    """The engine ``loading`` names (its model resolved): the one place this pipeline loads a model."""
    from detjac.engine import load_engine

    return load_engine(loading)


def heads_into_top_logit(g: AttributionGraph, top: int = 5) -> list[str]:
    """The line naming the ``top`` heads that carry the most of the loaded links into the graph's top logit
    or its asked target (:func:`detjac.graphs.strongest_heads` of its head loadings)."""
    from detjac.graphs import strongest_heads

    assert g.head_loadings is not None  # asked for
    links, total, heads = strongest_heads(g.head_loadings, g.adjacency, g.adjacency.shape[0] - g.n_logits, top)
    into = g.target_names[0]
    if not links:
        return [f"no loaded link goes into {into}"]
    best = ", ".join(f"L{layer}.H{head} {w:+.3g}" for layer, head, w in heads)
    return [f"into {into} ({links} loaded link{'s' if links != 1 else ''}, weight {total:.3g}): {best}"]


def _neuron_index(path: str | Path, identity: Mapping[str, Any], convention: str | None) -> NeuronIndex:
    """The neuron index at ``path``, refused (by name) unless made with this model and detach convention."""
    from detjac.store import open_neuron_index

    index = open_neuron_index(path)
    digest = identity.get("weights_sha256")  # none for a model without files: its shape is compared once traced
    index.check({"convention": convention, **({"weights_sha256": digest} if digest else {})})
    return index


def _groups(g: AttributionGraph, index: NeuronIndex) -> tuple[list[tuple[str, list[int]]], tuple[str, str]]:
    """The graph's neurons grouped (:func:`detjac.analysis.group_neurons`) as supernodes (label, neuron rows), and
    how many neurons the groups hold and how exact they are."""
    from detjac.analysis import group_adjacency, group_completeness, group_neurons

    groups = group_neurons(index, g.neurons)
    grouped, _, _ = group_adjacency(g.adjacency, g.activations, groups, g.n_neurons)
    worst = group_completeness(g.completeness, g.activations, groups)
    labelled = [(f"group {k}: {g.labels[members[0]]}", members) for k, members in enumerate(groups)]
    return labelled, (f"{len(groups)} of {sum(map(len, groups))} neurons",
                      f"grouped adjacency {grouped.shape[0]} nodes; worst group completeness {worst:.1e}")
