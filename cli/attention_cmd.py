"""``detjac attention``: why one head attends where it does, as exact QK terms (a JSON file and a table)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from detjac.graph_settings import HEAD_RANKINGS
from detjac.model_settings import LoadSpec
from detjac.qk_sums import attended_key, listed

from .attention_pages import graph_attention_pages
from .options import (
    check_out,
    model_argument,
    model_options,
    model_reads,
    out_option,
    prompt_options,
    refuse_options,
)

if TYPE_CHECKING:
    from detjac.engine import ModelRef


@click.command("attention")
@model_argument()
@prompt_options(required=False)
@model_options()
@click.option("--layer", type=int, default=None, help="The attention layer (0-based).")
@click.option("--head", type=int, default=None, help="Its query head (0-based).")
@click.option("--graph", "graph", type=click.Path(dir_okay=False), default=None,
              help="A graph JSON of this model and prompt (detjac graph): write the attention files of the first "
                   "--top-heads heads of its heads panel, at its target position, in one model load.")
@click.option("--top-heads", type=click.IntRange(min=1), default=None,
              help="With --graph: how many of its ranked heads [default: 10].")
@click.option("--heads-by", type=click.Choice(HEAD_RANKINGS), default="effect", show_default=True,
              help="With --graph: rank the heads by the size of their exact direct effect on the graph's target "
                   "(every head), or by the share of the top logit they carry through its loaded links (a graph "
                   "made with --heads N).")
@click.option("--query", type=int, default=None,
              help="The query position (negative: from the end) [default: the last; with --graph, its target's].")
@click.option("--neurons", type=int, default=0, show_default=True,
              help="Split each MLP into its N neurons writing the most at each position and a remainder.")
@out_option("Write every term as JSON here (a .json file); with --graph, a folder for the heads' files "
            "(GRAPH.qk.L{layer}.H{head}.json) [default: the graph's folder, where detjac view finds them].")
@click.option("--key", "key", type=click.IntRange(min=0), default=None,
              help="The key position explained [default: the most attended].")
@click.option("--contrast", "other", type=click.IntRange(min=0), default=None,
              help="The key position it is contrasted with [default: the next-most-attended].")
@click.option("--top", type=click.IntRange(min=1), default=8, show_default=True,
              help="Rows printed per table (the others summed in one row).")
def attention(model: ModelRef, prompt: str | None, model_options: LoadSpec, layer: int | None, head: int | None,
              graph: str | None, top_heads: int | None, heads_by: str, query: int | None, neurons: int,
              out: str | None, force: bool, key: int | None, other: int | None, top: int) -> None:
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

    With --graph G.json (instead of --layer and --head), the heads ranked first by G's heads panel (by their direct
    effect on G's target; --heads-by share: by what they carry of its loaded links) get their attention files, each
    at G's target position (the prompt: G's), written beside G as G.qk.L{layer}.H{head}.json (or into the folder
    --out), loading the model once; detjac view G.json then links each head to its page.

    \b
    Examples:
      detjac attention -p "Copper, n. A common metal" --layer 3 --head 1 --out qk.json
      detjac attention model.gguf -p "The capital of France is" --layer 10 --head 4 --neurons 5
      detjac attention -p "Copper, n. A common metal" --layer 3 --head 1 --contrast 0
      detjac graph -p "Copper, n. A" --heads 20 --out copper.json
      detjac attention --graph copper.json --top-heads 5      # copper.qk.L{l}.H{h}.json beside it
      detjac attention --graph copper.json --top-heads 5 --heads-by share
    """
    if graph is not None:
        if layer is not None or head is not None or key is not None or other is not None:
            raise click.UsageError("Expected no --layer, --head, --key or --contrast with --graph: its heads panel "
                                   "picks the heads.")
        _graph_pages(model, prompt, model_options, graph, top_heads or 10, query, neurons, out, force, heads_by)
        return
    if layer is None or head is None or prompt is None or top_heads is not None:
        raise click.UsageError("Expected --layer, --head and a prompt (--prompt or --prompt-file), or --graph G.json "
                               "(with --top-heads). Got " + (
                                   "--top-heads without --graph." if top_heads is not None else "a part of them."))
    _one_head(model, prompt, model_options, layer, head, query, neurons, out, force, key, other, top)


def _one_head(model: ModelRef, prompt: str, model_options: LoadSpec, layer: int, head: int, query: int | None,
              neurons: int, out: str | None, force: bool, key: int | None, other: int | None, top: int) -> None:
    if out is not None:  # before torch is imported, and not into what MODEL reads
        check_out(out, force=force, suffix=".json", reads=model_reads(model))
    from detjac.engine import load_engine, qk_attribution
    from detjac.runs import model_identity

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
        data = res.write(out, force=force, model={"source": model.name, **identity})
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
    click.echo(f"explained    {about}")
    for side, at, title, other in (("query_sums", i, "query side", "key"), ("key_sums", key, "key side", "query")):
        click.echo(f"{title} at {at} {tokens[at]!r}, each component's sum over the {other} side:")
        _rows([(s["component"], s["value"]) for s in best[side]], top, "components")
    click.echo(f"top terms at {about}:")
    for t in best["terms"][:top]:
        click.echo(f"  {t['query']:>12} x {t['key']:<12} {t['value']:>10.4g}")
    _, n_rest, rest = listed([("", t["value"]) for t in best["terms"]], top)
    if n_rest:
        click.echo(f"  {f'the other {n_rest} terms':<27} {rest:>10.4g}")


def _graph_pages(model: ModelRef, prompt: str | None, model_options: LoadSpec, graph: str, n_heads: int,
                 query: int | None, neurons: int, out: str | None, force: bool, by: str) -> None:
    """``--graph``: :func:`graph_attention_pages`, the model loaded once every file is checked."""

    def load() -> Any:
        from detjac.engine import load_engine

        return load_engine(model_options)

    refuse_options(model_options, "detjac attention", "a QK attribution needs the whole model in memory",
                   streamed=False, max_memory=None)
    graph_attention_pages(load, model, graph, n_heads, model_reads=model_reads(model), prompt=prompt, query=query,
                          neurons=neurons, out=out, force=force, by=by)


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
