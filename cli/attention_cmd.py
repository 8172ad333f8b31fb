"""``detjac attention``: why one head attends where it does, as exact QK terms (a JSON file and a table)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from detjac.model_settings import LoadSpec
from detjac.qk_sums import attended_key, listed

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
@click.option("--key", "key", type=click.IntRange(min=0), default=None,
              help="The key position explained [default: the most attended].")
@click.option("--contrast", "other", type=click.IntRange(min=0), default=None,
              help="The key position it is contrasted with [default: the next-most-attended].")
@click.option("--top", type=click.IntRange(min=1), default=8, show_default=True,
              help="Rows printed per table (the others summed in one row).")
def attention(model: ModelRef, prompt: str, model_options: LoadSpec, layer: int, head: int, query: int | None,
              neurons: int, out: str | None, force: bool, key: int | None, other: int | None, top: int) -> None:
    """Exact QK attribution of one attention head at one query position.

    The head's pre-softmax score at each key the mask allows (scaled, before the mask and any soft-cap) is split
    into one term per pair of residual-stream components at layer LAYER's input: the query's component at the
    query position against the key's at the key position. Components: E (token embedding), B (position
    embeddings), A{l}.{h} (head h of an earlier layer l), M{l} (an earlier MLP; M{l}.{i} and M{l}.rest with
    --neurons), B{l} (a layer's biases) and bias (the head's own query or key constants). The norm scales are
    frozen at their values, so the terms sum to the real model's score exactly. Prints the attention pattern, then
    for the explained key (--key) each query-side component's sum over the key side and each key-side component's
    over the query side, the largest pairs, and the contrast with another key (--contrast): the score difference
    split per query-side and per key-side component. Every table ends with what its other rows add up to, so it
    sums to its total. --out keeps every pair.

    \b
    Examples:
      detjac attention -p "Copper, n. A common metal" --layer 3 --head 1 --out qk.json
      detjac attention model.gguf -p "The capital of France is" --layer 10 --head 4 --neurons 5
      detjac attention -p "Copper, n. A common metal" --layer 3 --head 1 --contrast 0
    """
    from detjac.engine import load_engine, qk_attribution, write_qk
    from detjac.runs import model_identity

    if out is not None:  # again, now that MODEL is resolved: not into what it reads
        check_out(out, force=force, suffix=".json", reads=model_reads(model))
    refuse_options(model_options, "detjac attention", "a QK attribution needs the whole model in memory",
                   streamed=False, max_memory=None)
    res = qk_attribution(load_engine(model_options), prompt, layer, head, query=query, neurons=neurons)
    key = attended_key({k["position"]: k["probability"] for k in res.keys}, key)  # refused: nothing written
    contrast = res.contrast(key, other) if len(res.keys) > 1 or other is not None else None
    _echo(res, model.name, top, key)
    if contrast is not None:
        _echo_contrast(res, contrast, top)
    if out is not None:
        identity = {k: v for k, v in model_identity(model.source).items() if isinstance(v, str)}
        data = write_qk(res, out, force=force, model={"source": model.name, **identity})
        click.echo(f"wrote        {out} ({len(data['keys'])} keys, {sum(len(k['terms']) for k in data['keys'])} "
                   "terms)")


def _echo(res: Any, model: str, top: int, key: int) -> None:
    info, tokens, i = res.info["model"], res.tokens, res.query_position
    click.echo(f"model        {model} ({info['family']}, {info['dtype']}); {len(tokens)} tokens")
    click.echo(f"attention    layer {res.layer} head {res.head}, query {i} {tokens[i]!r}; "
               f"{len(res.query_components)} components a side")
    click.echo(f"exactness    terms vs score {res.score_error:.1e}, components vs residual {res.residual_error:.1e}")
    click.echo(f"{'key':>5}  {'token':<16} {'p':>7} {'score':>10}")
    for k in res.keys:
        j = k["position"]
        click.echo(f"{j:>5}  {tokens[j]!r:<16} {k['probability']:>7.3f} {k['score']:>10.4g}")
    best = next(k for k in res.keys if k["position"] == key)
    about = f"key {key} {tokens[key]!r} (p={best['probability']:.3f}, score {best['score']:.4g})"
    for side, at, title in (("query_sums", i, "query side"), ("key_sums", key, "key side")):
        click.echo(f"{title} at {at} {tokens[at]!r}, each component summed over the other side, at {about}:")
        _rows([(s["component"], s["value"]) for s in best[side]], top, "components")
    click.echo(f"top terms at {about}:")
    for t in best["terms"][:top]:
        click.echo(f"  {t['query']:>12} x {t['key']:<12} {t['value']:>10.4g}")
    _, n_rest, rest = listed([("", t["value"]) for t in best["terms"]], top)
    if n_rest:
        click.echo(f"  {f'the other {n_rest} terms':<27} {rest:>10.4g}")


def _echo_contrast(res: Any, contrast: dict[str, Any], top: int) -> None:
    tokens, j, o = res.tokens, contrast["key"], contrast["other"]
    scores = {k["position"]: k["score"] for k in res.keys}
    click.echo(f"contrast     key {j} {tokens[j]!r} against key {o} {tokens[o]!r}: score difference "
               f"{contrast['difference']:.4g} ({scores[j]:.4g} - {scores[o]:.4g})")
    for side, title in (("query_sums", "query side"), ("key_sums", "key side")):
        click.echo(f"{title}, each component's part of the difference:")
        _rows([(s["component"], s["value"]) for s in contrast[side]], top, "components")


def _rows(rows: list[tuple[str, float]], top: int, what: str) -> None:
    """The first ``top`` rows and the row of the others' sum: the table adds up to its total."""
    shown, n_rest, rest = listed(rows, top)
    for name, value in shown:
        click.echo(f"  {name:<27} {value:>10.4g}")
    if n_rest:
        click.echo(f"  {f'the other {n_rest} {what}':<27} {rest:>10.4g}")
