"""``detjac graph``: the exact attribution graph of one prediction, as circuit-tracer's graph JSON."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

import click

from detjac.graph_nodes import NEURON
from detjac.graph_settings import KEPT_SHARE_MEANING
from detjac.model_settings import LoadSpec

from .graph_options import graph_options
from .options import (
    check_out,
    model_argument,
    model_options,
    model_reads,
    prompt_options,
    refuse_options,
)

if TYPE_CHECKING:
    from detjac.engine import ModelRef
    from detjac.graph_settings import GraphSettings


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
@graph_options()
@click.option("--slug", default=None, help="The graph's name in the frontend [default: the --out file's stem].")
@click.option("--neurons", "neuron_index", default=None, type=click.Path(exists=True, file_okay=False),
              help="A neuron index of this model (`detjac neurons`): each neuron's label (clerp) becomes the most "
                   "frequent tokens at its top activations in that corpus, then its write vector's top tokens.")
@click.option("--group", is_flag=True,
              help="With --neurons: group the neurons of a layer whose top contexts and write tokens agree into "
                   "supernodes (circuit-tracer's qParams.supernodes; a group's links are its members' sums). "
                   "`detjac view` draws each group as one node; a click expands it.")
@click.option("--attention-pages", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also write the attention files (`detjac attention`) of the graph's N heads of largest direct "
                   "effect on its target (its heads panel's first), at its target position, beside --out "
                   "(STEM.qk.L{l}.H{h}.json), with the same model load; in memory only.")
def graph(model: ModelRef, prompt: str, model_options: LoadSpec, out: str, force: bool, graph: GraphSettings,
          slug: str | None, neuron_index: str | None, group: bool, attention_pages: int) -> None:
    """Exact attribution graph of MODEL's prediction on one prompt.

    Nodes are the input tokens, MLP neurons and the top logits (at most 10, until their probabilities
    reach 0.95), or the one --target (a logit against the mean, or a contrast of two); --aside-first
    takes the graph of the same frozen system without the first position's own contribution. Each
    token's exact contribution to the target is printed, and kept in the JSON. With attention
    probabilities, norm scales and every MLP's gate frozen, the model is linear in the embeddings and
    the neurons, so each node's incoming edges (direct effects, every other MLP held at its neurons)
    sum to its value exactly: no transcoder, no error nodes. Writes
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
      detjac graph -p "Copper, n. A" --out copper.json --qk 1.0 --qk 3.2   # QK records of two heads
      detjac graph -p "Copper, n. A" --out copper.json --heads 50 --attention-pages 3   # and 3 heads' pages
      detjac graph SmolLM2-135M-Instruct.Q4_1.gguf -p "The capital of France is" --out contrast.json \
          --target "' Paris' - ' the'" --aside-first   # a contrast, the first position set aside
      detjac view france.json --neurons neurons.zarr     # groups collapsed, neuron pages on a click
      python -c "from circuit_tracer.frontend.local_server import serve; serve('.')"   # then open :8032
    """
    from detjac.runs import graph_file

    if attention_pages:
        refuse_options(model_options, "--attention-pages", "an attention page needs the whole model in memory",
                       streamed=False, max_memory=None)
    check_out(out, force=force, suffix=".json",
              reads=[*model_reads(model), *([("the neuron index", neuron_index)] if neuron_index else [])])
    done = graph_file(model, prompt, model_options, out, graph, slug=slug, neuron_index=neuron_index, group=group,
                      force=force)
    g, data, index = done.graph, done.data, done.index
    nodes = data["nodes"]
    neurons = sum(1 for n in nodes if n["feature_type"] == NEURON.name)
    top = ", ".join(f"{t!r} p={p:.3f}" for t, p in zip(g.logit_tokens[:3], g.logit_probabilities[:3], strict=False))
    click.echo(f"model        {model.name} ({g.info['family']}, {g.info['dtype']}); {g.n_tokens} tokens")
    if g.target is None:
        click.echo(f"logits       {g.n_logits}: {top}{' ...' if g.n_logits > 3 else ''}")
    else:
        click.echo(f"target       {g.target} = {g.logit_values[0]:.4g} (p={g.logit_probabilities[0]:.3f} for "
                   f"{g.logit_tokens[0]!r})")
    if g.aside:
        click.echo("set aside    the first position: every value below is the frozen system's without its own "
                   "contribution")
    click.echo("tokens       " + _contributions(g))
    click.echo(f"neurons      {g.n_active} active, {g.n_neurons} ranked into the adjacency, {neurons} kept")
    click.echo(f"completeness {g.worst_completeness:.1e} (worst |sum of incoming edges - value| / |value|)")
    share = data["metadata"]["info"]["logit_share_kept"]
    click.echo("kept share   " + ", ".join(f"{t} {s:.2f}" for t, s in zip(g.target_names, share, strict=False)))
    for line in textwrap.wrap(KEPT_SHARE_MEANING, 100):
        click.echo(f"             {line}")
    if g.head_loadings is not None:
        click.echo(f"heads        {len(g.head_loadings.links)} links split by attention head in "
                   f"{g.info['head_loadings_seconds']:.1f} s; worst |heads + skip - weight| / |weight| "
                   f"{g.head_loadings.error:.1e}")
        for line in done.heads:
            click.echo(f"             {line}")
    for node in (n for n in nodes if "qk_tracing_results" in n):
        q = node["qk_tracing_results"]["top_q_marginal_contributors"]
        click.echo(f"qk           {node['clerp']}: score {node['activation']:.4g}, {len(q)} query-side components "
                   "(qk_tracing_results)")
    if done.groups:
        click.echo(f"groups       {done.groups[0]} ({len(data['qParams']['supernodes'])} with kept nodes); "
                   f"{done.groups[1]}")
    if index is not None:
        click.echo(f"labels       from the neuron index {neuron_index} ({index.attrs['n_tokens']} tokens of "
                   f"{index.identity.get('prompts')} prompts)")
    click.echo(f"wrote        {out} ({len(nodes)} nodes, {len(data['links'])} links) in {done.seconds:.1f} s")
    if attention_pages:
        from .attention_pages import graph_attention_pages

        graph_attention_pages(lambda: done.engine, model, out, attention_pages, model_reads=model_reads(model),
                              force=force)


def _contributions(g: object) -> str:
    """The first target's per-token contributions, largest first (the line ``tokens``)."""
    values = g.token_contributions[0]  # type: ignore[attr-defined]
    order = sorted(range(len(values)), key=lambda q: -abs(values[q]))[:5]
    listed = ", ".join(f"{g.tokens[q]!r} {values[q]:+.3f}" for q in order)  # type: ignore[attr-defined]
    rest = g.constants_contribution[0]  # type: ignore[attr-defined]
    constants = f", constants {rest:+.3f}" if g.n_biases else ""  # type: ignore[attr-defined]
    target = g.target_names[0]  # type: ignore[attr-defined]
    return f"{listed}{constants}: each token's exact contribution to {target} (together they sum to it)"
