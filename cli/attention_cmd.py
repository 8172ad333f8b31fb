"""``detjac attention``: why one head attends where it does, as exact QK terms (a JSON file and a table)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from detjac.model_settings import LoadSpec

from .options import (
    check_out,
    model_argument,
    model_options,
    model_reads,
    out_option,
    output_check,
    prompt_options,
    refuse_options,
)

if TYPE_CHECKING:
    from detjac.engine import ModelRef


@click.command("attention")
@model_argument()
@prompt_options()
@model_options()
@click.option("--layer", type=int, required=True, help="The attention layer (0-based).")
@click.option("--head", type=int, required=True, help="Its query head (0-based).")
@click.option("--query", type=int, default=None,
              help="The query position (negative: from the end) [default: the last].")
@click.option("--neurons", type=int, default=0, show_default=True,
              help="Split each MLP into its N neurons writing the most at each position and a remainder.")
@out_option("Write every term as JSON here (a .json file).", check=output_check(".json"))
@click.option("--top", type=click.IntRange(min=1), default=8, show_default=True,
              help="Terms printed for each of the three most attended keys.")
def attention(model: ModelRef, prompt: str, model_options: LoadSpec, layer: int, head: int, query: int | None,
              neurons: int, out: str | None, force: bool, top: int) -> None:
    """Exact QK attribution of one attention head at one query position.

    The head's pre-softmax score at each key the mask allows (scaled, before the mask and any soft-cap) is split
    into one term per pair of residual-stream components at layer LAYER's input: the query's component at the
    query position against the key's at the key position. Components: E (token embedding), B (position
    embeddings), A{l}.{h} (head h of an earlier layer l), M{l} (an earlier MLP; M{l}.{i} and M{l}.rest with
    --neurons), B{l} (a layer's biases) and bias (the head's own query or key constants). The norm scales are
    frozen at their values, so the terms sum to the real model's score exactly. Prints the attention pattern and
    the largest terms; --out keeps every pair.

    \b
    Examples:
      detjac attention -p "Copper, n. A common metal" --layer 3 --head 1 --out qk.json
      detjac attention model.gguf -p "The capital of France is" --layer 10 --head 4 --neurons 5
    """
    from detjac.engine import load_engine, qk_attribution, write_qk
    from detjac.runs import model_identity

    if out is not None:  # again, now that MODEL is resolved: not into what it reads
        check_out(out, force=force, suffix=".json", reads=model_reads(model))
    refuse_options(model_options, "detjac attention", "a QK attribution needs the whole model in memory",
                   streamed=False, max_memory=None)
    res = qk_attribution(load_engine(model_options), prompt, layer, head, query=query, neurons=neurons)
    _echo(res, model.name, top)
    if out is not None:
        identity = {k: v for k, v in model_identity(model.source).items() if isinstance(v, str)}
        data = write_qk(res, out, force=force, model={"source": model.name, **identity})
        click.echo(f"wrote        {out} ({len(data['keys'])} keys, {sum(len(k['terms']) for k in data['keys'])} "
                   "terms)")


def _echo(res: Any, model: str, top: int) -> None:
    info, tokens, i = res.info["model"], res.tokens, res.query_position
    click.echo(f"model        {model} ({info['family']}, {info['dtype']}); {len(tokens)} tokens")
    click.echo(f"attention    layer {res.layer} head {res.head}, query {i} {tokens[i]!r}; "
               f"{len(res.query_components)} components a side")
    click.echo(f"exactness    terms vs score {res.score_error:.1e}, components vs residual {res.residual_error:.1e}")
    click.echo(f"{'key':>5}  {'token':<16} {'p':>7} {'score':>10}")
    for key in res.keys:
        j = key["position"]
        click.echo(f"{j:>5}  {tokens[j]!r:<16} {key['probability']:>7.3f} {key['score']:>10.4g}")
    for key in sorted(res.keys, key=lambda k: -k["probability"])[:3]:
        j = key["position"]
        click.echo(f"top terms at key {j} {tokens[j]!r} (p={key['probability']:.3f}, score {key['score']:.4g}):")
        for t in key["terms"][:top]:
            click.echo(f"  {t['query']:>12} x {t['key']:<12} {t['value']:>10.4g}")
