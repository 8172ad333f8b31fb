"""The attribution graph's options, declared once for ``detjac graph`` and ``detjac run --graph``: one decorator
collapses them into the command's ``graph`` argument, a :class:`~detjac.graph_settings.GraphSettings` checked by its
own :meth:`~detjac.graph_settings.GraphSettings.check` (one validation, in the flags' words) before torch is
imported."""

from __future__ import annotations

import functools
from typing import Any

import click

from detjac.errors import InvalidArgumentError
from detjac.graph_settings import (
    EDGE_THRESHOLD,
    HEADS_INTO,
    MAX_NODES,
    NODE_THRESHOLD,
    GraphSettings,
    parse_qk_head,
)

# field -> (flag, takes the command's prefix, click settings); `run` declares the prefixed ones and --heads.
_OPTIONS: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "max_nodes": ("--max-nodes", True, dict(
        type=int, default=MAX_NODES, show_default=True,
        help="Neurons that enter the adjacency, ranked by their total attribution to the logits.")),
    "node_threshold": ("--node-threshold", True, dict(
        type=float, default=NODE_THRESHOLD, show_default=True,
        help="Pruning: keep the nodes that hold this share of the influence on the logits.")),
    "edge_threshold": ("--edge-threshold", True, dict(
        type=float, default=EDGE_THRESHOLD, show_default=True,
        help="Pruning: keep the edges that hold this share of the influence.")),
    "rows_per_pass": ("--rows", False, dict(
        type=int, default=None,
        help="Adjacency rows pulled back together (memory grows with it) [default: 128, or what --max-memory "
             "allows].")),
    "heads": ("--heads", False, dict(
        type=int, default=0, show_default=True,
        help="Split the N strongest links the written graph keeps (token or neuron to neuron or logit) by attention "
             "head: each gets head_loadings, per crossed layer every head's share and the skip, summing to its "
             "weight (docs/graphs.md, \"Head loadings\"). At most the graph's links.")),
    "heads_into": ("--heads-into", False, dict(
        type=click.Choice(HEADS_INTO), default="all", show_default=True,
        help="With --heads: the strongest links into any neuron or logit, or into the logits only.")),
    "qk": ("--qk", False, dict(
        multiple=True, metavar="L.H",
        help="Trace head H of layer L (as `detjac attention --layer L --head H` names it; repeatable): its exact QK "
             "attribution at the predicted position travels in the graph JSON as Neuronpedia's qk_tracing_results "
             "on the head's node (docs/graphs.md, \"QK records\"). The in-memory engine only.")),
    "target": ("--target", True, dict(
        default=None, metavar="TARGET",
        help="One logit target instead of the top logits: a token in quotes (\"' Paris'\": its logit against the "
             "mean), a contrast (\"' Paris' - ' London'\") or \"' Paris' - mean\"; #ID names a token by id. The "
             "per-token contributions, the ranking, the links, the head loadings and the heads' direct effects are "
             "all of it (docs/graphs.md, \"Targets\").")),
    "aside_first": ("--aside-first", True, dict(
        is_flag=True, default=False,
        help="Set the first position (usually the attention sink) aside: the same frozen system without the first "
             "position's own contribution (its embedding and the constants added there); every listed number is "
             "recomputed in it, none only hidden. The in-memory engine only.")),
}
# What a corpus run stores of a graph (its other settings are the defaults), with its own word for --heads.
_RUN_FIELDS = ("max_nodes", "node_threshold", "edge_threshold", "heads", "qk", "target", "aside_first")
_RUN_HEADS_HELP = ("Split each graph's N strongest links (token or neuron to neuron or logit, among those it keeps) by "
                   "attention head, stored with it (docs/graphs.md, \"Head loadings\"); a graph with fewer has all "
                   "of them split.")


def graph_options(prefix: str = "", switch: str | None = None) -> Any:
    """The graph settings' options collapsed into the command's ``graph`` argument.

    Parameters
    ----------
    prefix : str
        Put before the name of each option that takes it (``graph-``: ``--graph-max-nodes``).
    switch : str or None
        The help of a ``--graph`` flag that turns the graph on (a corpus run's: then only the settings its store
        records are declared, each said to need it, and ``graph`` is None without it); None: always a graph.

    Returns
    -------
    callable
        The decorator; apply it above the command's other options.
    """
    fields = _RUN_FIELDS if switch is not None else tuple(_OPTIONS)
    flags = {f: _flag(f, prefix) for f in fields}

    def decorate(func: Any) -> Any:
        @functools.wraps(func)
        def command(*args: Any, **kwargs: Any) -> Any:
            values = {f: kwargs.pop(f"graph_{f}") for f in fields}
            on = kwargs.pop("graph") if switch is not None else True
            if not on and values["heads"]:
                raise click.UsageError(f"Expected --heads with --graph (it splits links of each prompt's graph by "
                                       f"attention head). Got --heads {values['heads']} alone.")
            if not on and values["qk"]:
                raise click.UsageError(f"Expected --qk with --graph (it traces heads of each prompt's graph). Got "
                                       f"--qk {values['qk'][0]} alone.")
            if not on and (values["target"] is not None or values["aside_first"]):
                given = flags["target"] if values["target"] is not None else flags["aside_first"]
                raise click.UsageError(f"Expected {given} with --graph (it sets each prompt's graph's target). Got "
                                       f"{given} alone.")
            try:
                values["qk"] = tuple(parse_qk_head(text) for text in values["qk"])
                settings = GraphSettings(**values, heads_up_to=switch is not None).check(flags) if on else None
            except InvalidArgumentError as exc:
                raise click.UsageError(str(exc)) from None
            return func(*args, graph=settings, **kwargs)

        for f in reversed(fields):
            settings = dict(_OPTIONS[f][2])
            if switch is not None:
                settings["help"] = "With --graph: " + (_RUN_HEADS_HELP if f == "heads" else settings["help"])
            command = click.option(flags[f], f"graph_{f}", **settings)(command)
        if switch is not None:
            command = click.option("--graph", is_flag=True, help=switch)(command)
        return command

    return decorate


def _flag(field: str, prefix: str) -> str:
    flag, prefixed, _ = _OPTIONS[field]
    return f"--{prefix}{flag[2:]}" if prefixed else flag
