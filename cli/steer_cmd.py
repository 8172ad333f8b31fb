"""``detjac steer``: generate with a concept prompt's stored layer Jacobians added at one layer."""

from __future__ import annotations

from typing import Any

import click

from .analyze_cmds import TABLE_HELP
from .run_cmd import DTYPES


def _strengths(value: str) -> list[float]:
    try:
        values = [float(v) for v in value.split(",") if v.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"Expected comma-separated numbers such as 0,0.5,1,2. Got {value!r}.") from exc
    if not values:
        raise click.BadParameter(f"Expected at least one strength. Got {value!r}.")
    return values


def _concept_source(value: str) -> tuple[str, str]:
    path, sep, pid = value.rpartition(":")
    if not sep or not path or not pid:
        raise click.BadParameter(f"Expected STORE:PROMPT_ID (e.g. run.zarr:3f2a9c0d1e2b4a5f). Got {value!r}.")
    return path, pid


def concept_operator(store: Any, prompt_id: str, layer: int, model: Any) -> Any:
    """The steering operator from a stored prompt's ``layer.<layer>`` Jacobian, checked against ``model``."""
    import numpy as np
    import torch

    from detjac.engine.steer import SteeringOperator
    from detjac.errors import InvalidArgumentError

    prompt = store.get(prompt_id)
    n_layers = model.config.get_text_config().num_hidden_layers
    if not -n_layers <= layer < n_layers:
        raise InvalidArgumentError(f"Expected a layer in [-{n_layers}, {n_layers}). Got {layer}.")
    layer %= n_layers
    target = f"layer.{layer}"
    if target not in prompt.layerwise_targets:
        raise InvalidArgumentError(
            f"Expected the layerwise Jacobian {target} with prompt {prompt_id}. Got "
            f"{', '.join(prompt.layerwise_targets) or 'no layerwise Jacobians'}: run `detjac run MODEL CONCEPT.txt "
            f"--out STORE --layers {layer} --components layer`.")
    stored = store.model_array("embedding").astype(np.float64)
    mine = model.get_input_embeddings().weight.detach().to("cpu", torch.float64).numpy()
    if stored.shape != mine.shape or np.linalg.norm(stored - mine) > 1e-2 * np.linalg.norm(mine):
        raise InvalidArgumentError(f"Expected the store's model to be this model. Got input embeddings of shape "
                                   f"{stored.shape} in the store and {mine.shape} in the model, or different values.")
    J = prompt.layerwise(target, lazy=False)
    return SteeringOperator.from_jacobian(layer, torch.from_numpy(np.asarray(J)).to(model.dtype), prompt.prompt)


@click.command("steer")
@click.argument("model", type=click.Path(), default="default", required=False)
@click.option("--concept-from", "concept", required=True,
              help="STORE:PROMPT_ID of a concept prompt stored with `--layers` (its layer.L Jacobian).")
@click.option("--layer", type=int, required=True, help="Layer whose output is steered (negative: from the end).")
@click.option("--strength", type=float, default=1.0, show_default=True,
              help="λ: the added vector's norm relative to the hidden state's.")
@click.option("--prompt", "-p", default=None, help="Prompt to continue, unsteered and steered.")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="File of prompts (one per line) for the measurement table across --strengths.")
@click.option("--strengths", default="0,0.5,1,2,4", show_default=True, help="λ values of the table (0: unsteered).")
@click.option("--concept-tokens", default=None,
              help="Comma-separated words counted as the concept, by their first token; mind leading spaces "
                   "(default: the concept prompt's tokens of 4+ letters).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=24, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--device", default="cpu", show_default=True, help="Torch device, e.g. cuda:0.")
@click.option("--table", "table_path", type=click.Path(dir_okay=False), default=None, help=TABLE_HELP)
def steer(model: str, concept: str, layer: int, strength: float, prompt: str | None, prompts_file: str | None,
          strengths: str, concept_tokens: str | None, max_new_tokens: int, dtype: str, device: str,
          table_path: str | None) -> None:
    """Steer MODEL's generation with a concept prompt's layer-L detached Jacobians.

    The concept prompt's operators J_1 ... J_n of layer L (stored by `detjac run --layers`)
    are applied to the new text's embeddings, summed (aligned at the end, as a filter over
    the sequence) and added to layer L's output at every position with norm λ times the
    hidden state's. Greedy decoding, so runs are reproducible.

    With --prompt: the unsteered and the steered continuation. With --prompts: a table of
    how often the concept's tokens appear in the continuations across --strengths.

    \b
    Examples:
      detjac run default concept.txt --out c.zarr --layers 1 --components layer
      detjac steer default --concept-from c.zarr:3f2a9c0d1e2b4a5f --layer 1 --strength 2 \\
          --prompt "Ream, n. A bundle, package, or quantity of"
      detjac steer default --concept-from c.zarr:3f2a9c0d1e2b4a5f --layer 1 --prompts p.txt \\
          --strengths 0,1,2,4 --concept-tokens " aquatic, mamm, sea" --table steer.csv
    """
    import torch

    from detjac.analysis import jobs
    from detjac.engine import get_tokenizer, load_model
    from detjac.engine.default import resolve_model
    from detjac.engine.steer import evaluate, generate
    from detjac.errors import InvalidArgumentError
    from detjac.store import open_store

    if prompt is None and prompts_file is None:
        raise click.UsageError("Expected --prompt TEXT or --prompts FILE. Got neither.")
    store_path, pid = _concept_source(concept)
    lm = load_model(resolve_model(model), dtype=getattr(torch, dtype), device=device)
    tok = get_tokenizer(lm)
    if tok is None:
        raise InvalidArgumentError(f"Expected a tokenizer with {model} to encode prompts. Got none.")
    op = concept_operator(open_store(store_path), pid, layer, lm)
    click.echo(f"concept {op.concept[:80]!r}: {op.operators.shape[0]} operators of layer {op.layer}")
    if prompt is not None:
        ids = tok(prompt)["input_ids"]
        click.echo(f"prompt    {prompt!r}")
        click.echo(f"unsteered {tok.decode(generate(lm, ids, max_new_tokens))!r}")
        click.echo(f"λ={strength:<7g} {tok.decode(generate(lm, ids, max_new_tokens, op, strength))!r}")
    if prompts_file is not None:
        with open(prompts_file, encoding="utf-8") as handle:
            prompts = [line.strip() for line in handle if line.strip()]
        if not prompts:
            raise InvalidArgumentError(f"Expected prompts in {prompts_file}. Got only blank lines.")
        if concept_tokens is not None:
            ids = {first for t in concept_tokens.split(",") if t
                   for first in tok(t, add_special_tokens=False)["input_ids"][:1]}
        else:
            ids = {t for t in tok(op.concept)["input_ids"] if sum(c.isalpha() for c in tok.decode([t])) >= 4}
        click.echo("concept tokens: " + " ".join(repr(tok.decode([t])) for t in sorted(ids)))
        rows = evaluate(lm, tok, op, prompts, _strengths(strengths), ids, max_new_tokens, progress=True)
        click.echo(f"{'λ':>6} {'prompts':>7} {'with concept':>12} {'concept/gen':>11} {'distinct':>8}  example")
        for r in rows:
            click.echo(f"{r['strength']:>6g} {r['prompts']:>7} {r['share_with_concept']:>12.0%} "
                       f"{r['concept_per_continuation']:>11.2f} {r['distinct_share']:>8.2f}  {r['example'][:60]!r}")
        if table_path:
            click.echo(f"wrote {jobs.write_table(rows, table_path)}")
