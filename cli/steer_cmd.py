"""``detjac steer``: generate with a concept prompt's stored layer Jacobians added at one layer.

The steering runs in :mod:`detjac.runs.steering`; this module parses, calls it and prints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from detjac.model_settings import LoadSpec

from . import render
from .options import (
    TABLE_HELP,
    check_results,
    model_argument,
    model_options,
    parse_concept_source,
    parse_strengths,
    prompt_options,
    refuse_options,
)

if TYPE_CHECKING:
    from detjac.engine import ModelRef


@click.command("steer")
@model_argument()
@click.option("--concept-from", "concept", required=True,
              help="STORE:PROMPT_ID of a concept prompt stored with `--layers` (its layer.L Jacobian; "
                   "layer_normed.L or layer.L with --method paper).")
@click.option("--layer", type=int, required=True, help="Layer whose output is steered (negative: from the end).")
@click.option("--strength", type=float, default=1.0, show_default=True,
              help="λ: the added vector's norm relative to the hidden state's.")
@prompt_options(required=False)
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="File of prompts (one per line) for the measurement table across --strengths.")
@click.option("--strengths", default="0,0.5,1,2,4", show_default=True, help="λ values of the table (0: unsteered).")
@click.option("--concept-tokens", default=None,
              help="Comma-separated words counted as the concept, by their first token; mind leading spaces "
                   "(default: the concept prompt's tokens of 4+ letters).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=24, show_default=True)
@click.option("--method", type=click.Choice(("detjac", "paper")), default="detjac", show_default=True,
              help="detjac: layer.L operators aligned at the end, added to layer L's output from position 1 on; "
                   "paper: the reference's procedure (layer_normed.L operators aligned from the start, summed "
                   "cumulatively, half the strength, added to layer L's input at every position).")
@click.option("--table", "table_path", type=click.Path(dir_okay=False), default=None, help=TABLE_HELP)
@model_options(dtype="float32")
def steer(model: ModelRef, concept: str, layer: int, strength: float, prompt: str | None, prompts_file: str | None,
          strengths: str, concept_tokens: str | None, max_new_tokens: int, method: str, table_path: str | None,
          model_options: LoadSpec) -> None:
    """Steer MODEL's generation with a concept prompt's layer-L detached Jacobians.

    The concept prompt's operators J_1 ... J_n of layer L (stored by `detjac run --layers`)
    are applied to the new text's embeddings, summed (aligned at the end, as a filter over
    the sequence) and added to layer L's output at every position with norm λ times the
    hidden state's. With --method paper, the paper's procedure instead: the layer_normed.L
    operators (or layer.L times the final norm's gain), aligned from the start and summed
    cumulatively, added to layer L's input at every position with norm λ/2 times the hidden
    state's. Greedy decoding, so runs are reproducible.

    With --prompt: the unsteered and the steered continuation. With --prompts: a table of
    how often the concept's tokens appear in the continuations across --strengths.

    \b
    Examples:
      detjac run default concept.txt --out c.zarr --layers 1 --components layer
      detjac steer default --concept-from c.zarr:3f2a9c0d1e2b4a5f --layer 1 --strength 2 \\
          --prompt "Ream, n. A bundle, package, or quantity of"
      detjac steer default --concept-from c.zarr:3f2a9c0d1e2b4a5f --layer 1 --prompts p.txt \\
          --strengths 0,1,2,4 --concept-tokens " aquatic, mamm, sea" --table steer.csv
      detjac run default concept.txt --out n.zarr --layers 1 --components layer_normed
      detjac steer default --concept-from n.zarr:3f2a9c0d1e2b4a5f --layer 1 --method paper \\
          --prompt "Ream, n. A bundle of"
    """
    from detjac.runs import evaluate_steering, load_concept, prepare_evaluation, steer_prompt

    if prompt is None and prompts_file is None:
        raise click.UsageError("Expected --prompt TEXT or --prompts FILE. Got neither.")
    o = model_options
    refuse_options(o, "detjac steer", "steering generates text with the whole model in memory", streamed=False,
                   max_memory=None)
    store_path, pid = parse_concept_source(concept)
    check_results([store_path], files=(table_path,))
    values = parse_strengths(strengths) if prompts_file is not None else []
    session = load_concept(o, store_path, pid, layer, method=method)
    op = session.operator
    click.echo(f"concept {op.concept[:80]!r}: {op.operators.shape[0]} operators of layer {op.layer} "
               f"(method {op.method})")
    if prompt is not None:
        steered = steer_prompt(session, prompt, strength, max_new_tokens)
        click.echo(f"prompt    {prompt!r}")
        click.echo(f"unsteered {steered.unsteered!r}")
        click.echo(f"λ={strength:<7g} {steered.steered!r}")
    if prompts_file is not None:
        evaluation = prepare_evaluation(session, prompts_file, concept_tokens)
        click.echo("concept tokens: " + " ".join(repr(t) for t in evaluation.concept_tokens))
        table = evaluate_steering(session, evaluation, values, max_new_tokens, table_path)
        render.echo_steering_table(table.rows)
        if table.table is not None:
            click.echo(f"wrote {table.table}")
