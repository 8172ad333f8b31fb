"""The attention files of a graph's strongest heads (``detjac attention --graph`` and ``detjac graph
--attention-pages``): shared by the two commands, as the graph options are."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from detjac.errors import InvalidArgumentError

if TYPE_CHECKING:
    from detjac.engine import ModelRef

_RANKED = {"effect": "|direct effect| on the target", "share": "carried share"}


def graph_attention_pages(load: Callable[[], Any], model: ModelRef, graph: str, n_heads: int, *,
                          model_reads: list[tuple[str, str]], prompt: str | None = None, query: int | None = None,
                          neurons: int = 0, out: str | None = None, force: bool = False, by: str = "effect"
                          ) -> list[Path]:
    """The attention files of the graph file ``graph``'s first ``n_heads`` heads (its heads panel's order, ranked
    ``by`` their direct effect on its target or their carried share: :func:`detjac.view.top_heads`), at its
    target position (or ``query``), for its prompt, written beside it as ``STEM.qk.L{l}.H{h}.json`` (or into the
    folder ``out``) and printed; what ``detjac attention --graph`` and ``detjac graph --attention-pages`` do.

    ``model_reads``: what the command reads of ``model`` (never written into). ``load`` gives the in-memory engine
    of ``model`` (loading it, or one already loaded); it is called once every file is checked and the graph's
    weights' SHA-256, where it records one, is ``model``'s.

    Raises
    ------
    InvalidArgumentError
        A graph that ranks no head, a file refused by :func:`detjac.outputs.check_output`, another model or prompt
        than the graph's: before anything is written.
    """
    from detjac.runs import attention_pages, attention_targets, model_identity
    from detjac.view import top_heads

    chosen = top_heads(graph, n_heads, by)
    folder = out if out is not None else str(Path(graph).parent)
    reads = [*model_reads, ("the graph", graph)]
    paths = attention_targets(folder, chosen.stem, chosen.heads, force=force, reads=reads)
    identity = {k: v for k, v in model_identity(model.source).items() if isinstance(v, str)}
    theirs, ours = chosen.info.get("weights_sha256"), identity.get("weights_sha256")
    if theirs and ours and theirs != ours:
        raise InvalidArgumentError(f"Expected the graph's model (weights_sha256 {str(theirs)[:64]}) for its heads' "
                                   f"attention files. Got {model.name} (weights_sha256 {ours}).")
    at = chosen.query if query is None else query
    token = chosen.tokens[at] if -len(chosen.tokens) <= at < len(chosen.tokens) else ""
    click.echo(f"graph        {graph}: {chosen.ranked} heads ranked by {_RANKED[by]}; the first "
               f"{len(chosen.heads)} at query {at} {token!r}")
    attention_pages(load(), prompt if prompt is not None else chosen.prompt, chosen.heads, folder, stem=chosen.stem,
                    query=at, tokens=chosen.tokens, neurons=neurons, force=force,
                    model={"source": model.name, **identity}, reads=reads)
    for (layer, head), path in zip(chosen.heads, paths, strict=True):
        click.echo(f"wrote        {path} (layer {layer} head {head})")
    return paths
