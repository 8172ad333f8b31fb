"""``detjac neurons``: a neuron index of a corpus (every MLP neuron's top contexts, histogram, logit effects).

The work is :func:`detjac.runs.build_neuron_index`; this module parses, calls it and prints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from detjac.model_settings import LoadSpec

from .options import (
    check_out,
    check_prompts,
    cluster_options,
    collect_model_options,
    corpus_options,
    force_new_option,
    model_argument,
    model_option,
    model_reads,
)

if TYPE_CHECKING:
    from detjac.engine import ModelRef
    from detjac.runs import ClusterOptions


@click.command()
@collect_model_options
@model_argument(required=True)
@click.argument("corpus", type=click.Path(), callback=check_prompts)
@click.option("--out", "-o", required=True, help="The index folder (created, or resumed), e.g. neurons.zarr.")
@click.option("--top-k", "-k", type=int, default=20, show_default=True,
              help="Contexts kept per neuron and sign (its K largest values, and its K most negative).")
@click.option("--shard", "shard_prompts", type=int, default=32, show_default=True,
              help="Prompts per shard: the unit of a commit (a kill loses at most one shard) and of a worker's task.")
@corpus_options(what="CORPUS")
@model_option("dtype")
@model_option("streamed")
@model_option("max_memory")
@model_option("device")
@model_option("revision")
@model_option("trust_remote_code")
@model_option("gguf_file")
@cluster_options(memory_limit="auto", work="the shards")
@force_new_option(replaces="an index made with another model or settings")
def neurons(model: ModelRef, corpus: str, out: str, model_options: LoadSpec, cluster: ClusterOptions,
            **settings: Any) -> None:
    """Index every MLP neuron of MODEL on the prompts of CORPUS: its top-K contexts of each sign (prompt, position,
    value), a histogram of its values, how often it is positive, and its write vector's top tokens through the
    unembedding. A neuron is the attribution graph's (`gate · up`, per expert for a mixture of experts).

    CORPUS is read as `detjac run` reads PROMPTS. Memory is bounded whatever its size; the index is committed
    (sealed, checksummed) after every shard, and the same command resumes a killed run. `detjac graph --neurons`
    and `detjac view --neurons` read it, and refuse an index made with another model or settings.

    \b
    Examples:
      detjac neurons default prompts.txt --out neurons.zarr
      detjac neurons SmolLM2-135M-Instruct.Q4_1.gguf corpus.jsonl --out smol-neurons.zarr --dtype float32 -k 20
      detjac neurons default prompts.txt --out neurons.zarr --workers 2
      detjac neurons big-model/ corpus.txt --out n.zarr --streamed --max-memory cpu=4GiB
    """
    from detjac.runs import NeuronOptions, build_neuron_index, read_prompts

    check_out(out, kind="store", reads=[("the corpus", corpus), *model_reads(model)])  # not inside a store or input
    prompts_format = settings.pop("prompts_format")
    source = read_prompts(corpus, prompts_format) if prompts_format else corpus
    options = NeuronOptions(load=model_options, cluster=cluster, **settings)
    outcome = build_neuron_index(model, source, out, options, log=click.echo)
    rate = outcome.computed_tokens / outcome.seconds if outcome.seconds > 0 else 0.0
    layers, per_layer = outcome.shape
    click.echo(f"wrote {outcome.path}: {layers} layers x {per_layer} neurons, {outcome.prompts} prompts, "
               f"{outcome.tokens} tokens ({outcome.computed_tokens} computed this run in {outcome.seconds:.1f} s, "
               f"{rate:.1f} tokens/s)")
