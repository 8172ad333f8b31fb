"""``detjac graph``: the exact attribution graph of one prediction, as circuit-tracer's graph JSON."""

from __future__ import annotations

import textwrap
import time
from typing import TYPE_CHECKING

import click

from detjac.graph_settings import EDGE_THRESHOLD, KEPT_SHARE_MEANING, MAX_NODES, NODE_THRESHOLD
from detjac.model_settings import LoadSpec

from .options import (
    check_heads_option,
    check_out,
    model_argument,
    model_options,
    model_reads,
    prompt_options,
)

if TYPE_CHECKING:
    from detjac.engine import AttributionGraph, ModelRef


def _check_out(ctx: click.Context, param: click.Parameter, out: str) -> str:
    """``--out``: a new .json file (or one ``--force``, read first, replaces), checked before torch is imported."""
    from detjac.errors import InvalidArgumentError

    try:
        check_out(out, force=bool(ctx.params.get("force")), suffix=".json")
    except InvalidArgumentError as exc:
        raise click.BadParameter(str(exc)) from None
    return out


@click.command("graph")
@model_argument()
@prompt_options()
@model_options()
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), callback=_check_out,
              help="Write the graph JSON here (a .json file; graph-metadata.json is updated beside it).")
@click.option("--force", is_flag=True, is_eager=True, help="Overwrite --out if it exists.")
@click.option("--max-nodes", type=click.IntRange(min=1), default=MAX_NODES, show_default=True,
              help="Neurons that enter the adjacency, ranked by their total attribution to the logits.")
@click.option("--node-threshold", type=click.FloatRange(0, 1), default=NODE_THRESHOLD, show_default=True,
              help="Pruning: keep the nodes that hold this share of the influence on the logits.")
@click.option("--edge-threshold", type=click.FloatRange(0, 1), default=EDGE_THRESHOLD, show_default=True,
              help="Pruning: keep the edges that hold this share of the influence.")
@click.option("--rows", "rows_per_pass", type=click.IntRange(min=1), default=None,
              help="Adjacency rows pulled back together (memory grows with it) [default: 128, or what "
                   "--max-memory allows].")
@click.option("--slug", default=None, help="The graph's name in the frontend [default: the --out file's stem].")
@click.option("--heads", type=int, default=0, show_default=True, callback=check_heads_option,
              help="Split the N strongest links the written graph keeps (token or neuron to neuron or logit) by "
                   "attention head: each gets head_loadings, per crossed layer every head's share and the skip, "
                   "summing to its weight (docs/graphs.md, \"Head loadings\"). At most the graph's links.")
@click.option("--heads-into", type=click.Choice(("all", "logits")), default="all", show_default=True,
              help="With --heads: the strongest links into any neuron or logit, or into the logits only.")
@click.option("--neurons", "neuron_index", default=None, type=click.Path(exists=True, file_okay=False),
              help="A neuron index of this model (`detjac neurons`): each neuron's label (clerp) becomes the most "
                   "frequent tokens at its top activations in that corpus, then its write vector's top tokens.")
@click.option("--group", is_flag=True,
              help="With --neurons: group the neurons of a layer whose top contexts and write tokens agree into "
                   "supernodes (circuit-tracer's qParams.supernodes; a group's links are its members' sums). "
                   "`detjac view` draws each group as one node; a click expands it.")
def graph(model: ModelRef, prompt: str, model_options: LoadSpec, out: str, force: bool, max_nodes: int,
          node_threshold: float, edge_threshold: float, rows_per_pass: int | None, slug: str | None,
          heads: int, heads_into: str, neuron_index: str | None, group: bool) -> None:
    """Exact attribution graph of MODEL's prediction on one prompt.

    Nodes are the input tokens, MLP neurons and the top logits (at most 10, until their probabilities
    reach 0.95). With attention probabilities, norm scales and every MLP's gate frozen, the model is
    linear in the embeddings and the neurons, so each node's incoming edges (direct effects, every
    other MLP held at its neurons) sum to its value exactly: no transcoder, no error nodes. Writes
    circuit-tracer's graph JSON (schema_version 1), pruned as circuit-tracer prunes; open it with
    circuit-tracer's local server or Neuronpedia.

    \b
    Examples:
      detjac graph -p "Copper, n. A" --out copper.json
      detjac graph SmolLM2-135M-Instruct.Q4_1.gguf -p "The capital of France is" --out france.json
      detjac graph model.gguf -p "..." --out g.json --streamed --max-memory cpu=2GiB
      detjac graph SmolLM2-135M-Instruct.Q4_1.gguf -p "The capital of France is" --heads 500 --out heads.json
      detjac graph SmolLM2-135M-Instruct.Q4_1.gguf -p "The capital of France is" --heads 100 --heads-into logits \
          --max-nodes 1000 --out paris.json
      detjac graph -p "The capital of France is" --out france.json --neurons neurons.zarr --group
      detjac view france.json --neurons neurons.zarr     # groups collapsed, neuron pages on a click
      python -c "from circuit_tracer.frontend.local_server import serve; serve('.')"   # then open :8032
    """
    from detjac.engine import attribution_graph, load_engine, write_graph
    from detjac.runs import model_identity
    if group and not neuron_index:
        raise click.UsageError("--group needs --neurons (a group is made of neurons whose pages agree).")
    check_out(out, force=force, suffix=".json",
              reads=[*model_reads(model), *([("the neuron index", neuron_index)] if neuron_index else [])])
    identity = model_identity(model.source)  # the weights' SHA-256, as a store's run records it
    index = _neuron_index(neuron_index, identity, model_options) if neuron_index else None
    engine = load_engine(model_options)
    started = time.perf_counter()
    g = attribution_graph(engine, prompt, max_nodes=max_nodes, rows_per_pass=rows_per_pass, heads=heads,
                          node_threshold=node_threshold, edge_threshold=edge_threshold, heads_into=heads_into,
                          progress=True)
    if index is not None:
        from detjac.analysis import relabel

        # the model's shape, known once traced: compared whether or not the index or the model has a digest
        index.check({k: g.info.get(k) for k in ("family", "n_layers", "neurons_per_layer")})
        g.labels = relabel(g.labels, g.neurons, index)
    supernodes, grouping = _groups(g, index) if group and index is not None else ([], None)
    data = write_graph(g, out, model=model.name, slug=slug, node_threshold=node_threshold,
                       edge_threshold=edge_threshold, force=force, supernodes=supernodes,
                       identity={k: v for k, v in identity.items() if isinstance(v, str)})
    nodes = data["nodes"]
    neurons = sum(1 for n in nodes if n["feature_type"] == "mlp neuron")
    top = ", ".join(f"{t!r} p={p:.3f}" for t, p in zip(g.logit_tokens[:3], g.logit_probabilities[:3], strict=False))
    click.echo(f"model        {model.name} ({g.info['family']}, {g.info['dtype']}); {g.n_tokens} tokens")
    click.echo(f"logits       {g.n_logits}: {top}{' ...' if g.n_logits > 3 else ''}")
    click.echo(f"neurons      {g.n_active} active, {g.n_neurons} ranked into the adjacency, {neurons} kept")
    click.echo(f"completeness {g.worst_completeness:.1e} (worst |sum of incoming edges - value| / |value|)")
    share = data["metadata"]["info"]["logit_share_kept"]
    click.echo("kept share   " + ", ".join(f"{t!r} {s:.2f}" for t, s in zip(g.logit_tokens, share, strict=False)))
    for line in textwrap.wrap(KEPT_SHARE_MEANING, 100):
        click.echo(f"             {line}")
    if g.head_loadings is not None:
        click.echo(f"heads        {len(g.head_loadings.links)} links split by attention head in "
                   f"{g.info['head_loadings_seconds']:.1f} s; worst |heads + skip - weight| / |weight| "
                   f"{g.head_loadings.error:.1e}")
        for line in strongest_heads(g):
            click.echo(f"             {line}")
    if grouping:
        click.echo(f"groups       {grouping[0]} ({len(data['qParams']['supernodes'])} with kept nodes); {grouping[1]}")
    if index is not None:
        click.echo(f"labels       from the neuron index {neuron_index} ({index.attrs['n_tokens']} tokens of "
                   f"{index.identity.get('prompts')} prompts)")
    click.echo(f"wrote        {out} ({len(nodes)} nodes, {len(data['links'])} links) in "
               f"{time.perf_counter() - started:.1f} s")


def strongest_heads(g: AttributionGraph, top: int = 5) -> list[str]:
    """The line naming the heads that carry the most of the loaded links into the top logit."""
    from detjac.engine import strongest_heads

    links, total, heads = strongest_heads(g.head_loadings, g.adjacency, g.adjacency.shape[0] - g.n_logits, top)
    if not links:
        return [f"no loaded link goes into {g.logit_tokens[0]!r}"]
    best = ", ".join(f"L{layer}.H{head} {w:+.3g}" for layer, head, w in heads)
    return [f"into {g.logit_tokens[0]!r} ({links} loaded link{'s' if links != 1 else ''}, weight {total:.3g}): {best}"]


def _neuron_index(path: str, identity: dict, model_options: LoadSpec):  # noqa: ANN202 - a NeuronIndex
    """The neuron index at ``path``, refused (by name) unless made with this model and detach convention."""
    from detjac.store import open_neuron_index

    index = open_neuron_index(path)
    digest = identity.get("weights_sha256")  # none for a model without files: its shape is compared once traced
    index.check({"convention": model_options.convention, **({"weights_sha256": digest} if digest else {})})
    return index


def _groups(g: AttributionGraph, index: object) -> tuple[list[tuple[str, list[int]]], tuple[str, str]]:
    """The graph's neurons grouped (:func:`detjac.analysis.group_neurons`) as supernodes (label, neuron rows), and
    the line saying how exact the groups are."""
    from detjac.analysis import group_adjacency, group_completeness, group_neurons

    groups = group_neurons(index, g.neurons)  # type: ignore[arg-type]
    grouped, _, _ = group_adjacency(g.adjacency, g.activations, groups, g.n_neurons)
    worst = group_completeness(g.completeness, g.activations, groups)
    labelled = [(f"group {k}: {g.labels[members[0]]}", members) for k, members in enumerate(groups)]
    return labelled, (f"{len(groups)} of {sum(map(len, groups))} neurons",
                      f"grouped adjacency {grouped.shape[0]} nodes; worst group completeness {worst:.1e}")
