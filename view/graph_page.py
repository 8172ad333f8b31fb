"""The graph page: one prompt's attribution graph, as ``detjac graph`` writes it (circuit-tracer's graph JSON,
schema_version 1; docs/graphs.md), drawn by the page itself (``static/graph_page.js``: plain SVG, nothing fetched).

What the page gets is the JSON checked and trimmed to what it draws: per node its id, type, layer row, position,
activation, influence, label, (logits) token and probability, and its drivers (:mod:`~detjac.view.graph_drivers`:
what the "what drives it" view shows); per link its source, target and weight; and the words that explain the kept
share and the drivers. Labels and token texts are passed on as they are (untrusted text: the page only ever sets
them as text). A graph comes from a prompt of a store (``StoredPrompt.graph()``, where the store has one:
:func:`stored_graph`) or from a file (:class:`~detjac.view.graph_file.GraphFile`, ``detjac view graph.json``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError
from ..graph_nodes import KINDS, TOKEN
from ..graph_nodes import LOGIT as LOGIT_KIND
from ..graph_nodes import NEURON as NEURON_KIND
from ..graph_settings import KEPT_SHARE_MEANING, crossed_layers
from .attention_file import link_attention
from .graph_drivers import DRIVERS, DRIVERS_MEANING, node_drivers
from .graph_figure import pinned_page
from .graph_groups import grouped_page
from .graph_heads import compact_loadings, head_effect_rows, head_ranking, parse_loadings
from .graph_target import target_panel
from .jsonable import jsonable

if TYPE_CHECKING:
    from ..store import StoredPrompt

EMBEDDING, NEURON, LOGIT = TOKEN.name, NEURON_KIND.name, LOGIT_KIND.name
NODE_TYPES = tuple(kind.name for kind in KINDS)
INFO_SHOWN = ("model", "family", "dtype", "n_layers", "neurons_per_layer", "exact", "error_nodes", "completeness",
              "edge_threshold", "max_nodes", "active_neurons", "nodes_before_pruning", "logit_share_kept",
              "weights_sha256")


def stored_graph(prompt: StoredPrompt) -> dict[str, Any] | None:
    """The prompt's graph JSON when its store keeps one (``StoredPrompt.graph()``; None for a store or a reader
    without graphs)."""
    reader = getattr(prompt, "graph", None)
    return reader() if callable(reader) else None


MAX_LAYERS = 100_000  # far more layers than any model has


def _row(layer: Any, where: str) -> int:
    """The node's row, bottom up: 0 for the tokens (layer ``E``), ``layer + 1`` for a numbered layer (neurons of
    layer l; the logits sit at ``n_layers + 1``)."""
    if str(layer) == "E":
        return 0
    try:
        row = -1 if isinstance(layer, str) and len(layer) > 12 else int(layer) + 1  # never a 5,000-digit int()
    except (TypeError, ValueError, OverflowError):
        row = -1
    if not 0 <= row <= MAX_LAYERS:
        raise InvalidArgumentError(f"Expected a node layer 'E' or a number from 0 to {MAX_LAYERS - 1} in {where}. "
                                   f"Got {str(layer)[:40]!r}.")
    return row


# circuit-tracer's and detjac's; detjac's contrast target ``Output " Paris" − " London" (p=0.773)``
LOGIT_CLERP = re.compile(r'^Output "(?P<token>.*?)"(?: − "(?P<minus>.*)")? \(p=[^)]*\)$', re.DOTALL)


def _logit_token(node: dict[str, Any]) -> tuple[str | None, str | None]:
    """A logit's token text and, for a contrast, the token it is taken against, read from its clerp
    (``Output " Paris" (p=0.773)``, ``Output " Paris" − " the" (p=0.773)``); the clerp itself otherwise."""
    clerp = str(node.get("clerp") or "")
    found = LOGIT_CLERP.match(clerp)
    return (found.group("token"), found.group("minus")) if found else (clerp or None, None)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_LAYERS else None


def _model_size(info: dict[str, Any], nodes: list[dict[str, Any]]) -> tuple[int | None, int | None]:
    """The model's layers (``info.n_layers``, else a logit's layer less one) and heads per layer (``info.n_heads``),
    None where the graph does not say."""
    logit_rows = [n["row"] for n in nodes if n["type"] == LOGIT]
    n_layers = _count(info.get("n_layers")) or (_count(logit_rows[0] - 2) if logit_rows else None)
    return n_layers, _count(info.get("n_heads"))


def _end(node: dict[str, Any]) -> tuple[str, int | None]:
    """A node as :func:`~detjac.graph_settings.crossed_layers` takes it: its kind and (a neuron's) layer."""
    return node["type"], node["row"] - 1 if node["type"] == NEURON else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def graph_payload(graph: Any, where: str = "the graph") -> dict[str, Any]:
    """What the graph page draws of ``graph`` (see the module docstring).

    Parameters
    ----------
    graph : dict
        circuit-tracer's graph JSON: ``metadata`` (``prompt_tokens``, ``info``, ...), ``nodes``, ``links``.
    where : str
        Where it came from, for messages.

    Returns
    -------
    dict
        ``metadata`` (``prompt``, ``prompt_tokens``, ``slug``, ``node_threshold``, ``info``, ``kept_share`` (the
        meaning of ``info.logit_share_kept``), ``drivers`` (``k``, ``computed``, ``meaning``)), ``nodes`` (``id``,
        ``type``, ``layer``, ``row``, ``ctx``, ``activation``, ``influence``, ``clerp``, ``p``, ``token`` (a logit's
        text, else None; a contrast's ``minus``, the token it is taken against), ``drivers`` (``[[node index,
        share], ...]`` or None: :func:`~detjac.view.graph_drivers.node_drivers`)) and ``links`` (``source``,
        ``target``, ``weight``, between listed nodes; ``heads``, a loaded link's
        :func:`~detjac.view.graph_heads.compact_loadings`);
        ``metadata.heads`` is the heads panel (:func:`~detjac.view.graph_heads.head_ranking`; its ``effects``, every
        head's direct effect: :func:`~detjac.view.graph_heads.head_effect_rows`), each head with the
        command that writes its attention file (``SLUG.qk.L{l}.H{h}.json``), and ``metadata.attention_command``
        (:func:`~detjac.view.attention_file.link_attention`); with ``qParams.supernodes``, ``groups``
        (:func:`~detjac.view.graph_groups.grouped_page`: each group's node and summed links); ``pinned``, the node
        ids of ``qParams.pinnedIds`` (:func:`~detjac.view.graph_figure.parse_pins`); ``metadata.target``, the
        target panel (:func:`~detjac.view.graph_target.target_panel`: each token's contribution to each logit node).

    Raises
    ------
    InvalidArgumentError
        ``graph`` is not such a JSON object (no nodes or links, a node without its id, layer or position, a link
        to an unknown node, head loadings that are not numbers or do not sum to their link's weight, supernodes
        that are not a list of ``[name, node id, ...]``, ...).
    """
    if not isinstance(graph, dict) or not isinstance(graph.get("nodes"), list) or \
            not isinstance(graph.get("links"), list):
        raise InvalidArgumentError(f"Expected circuit-tracer's graph JSON (an object with 'metadata', 'nodes' and "
                                   f"'links', as `detjac graph` writes) in {where}. Got {type(graph).__name__} "
                                   f"with keys {sorted(graph) if isinstance(graph, dict) else []}.")
    meta = graph.get("metadata") if isinstance(graph.get("metadata"), dict) else {}
    tokens = [str(t) for t in meta.get("prompt_tokens") or []]
    nodes = []
    for node in graph["nodes"]:
        if not isinstance(node, dict) or "node_id" not in node or not isinstance(node.get("ctx_idx"), int):
            raise InvalidArgumentError(f"Expected every node of {where} to have a node_id, a layer and a ctx_idx "
                                       f"(a position). Got {str(node)[:200]}.")
        kind = node.get("feature_type")
        token, minus = _logit_token(node) if kind == LOGIT else (None, None)
        nodes.append({"id": str(node["node_id"]), "type": kind if kind in NODE_TYPES else str(kind),
                      "layer": str(node.get("layer")), "row": _row(node.get("layer"), where),
                      "ctx": node["ctx_idx"], "activation": _number(node.get("activation")),
                      "influence": _number(node.get("influence")), "clerp": str(node.get("clerp") or ""),
                      "p": _number(node.get("token_prob")),
                      "token": token, **({"minus": minus} if minus is not None else {})})
    known = {node["id"]: node for node in nodes}
    info = meta.get("info") if isinstance(meta.get("info"), dict) else {}
    n_layers, n_heads = _model_size(info, nodes)
    links, loadings = [], []
    for link in graph["links"]:
        if not isinstance(link, dict) or link.get("source") not in known or link.get("target") not in known or \
                _number(link.get("weight")) is None:
            raise InvalidArgumentError(f"Expected every link of {where} to join two of its nodes with a numeric "
                                       f"weight. Got {str(link)[:200]}.")
        links.append({"source": link["source"], "target": link["target"], "weight": float(link["weight"])})
        loads, ends = link.get("head_loadings"), f"{str(link['source'])[:40]} -> {str(link['target'])[:40]}"
        crossed = crossed_layers(_end(known[link["source"]]), _end(known[link["target"]]), n_layers)
        loadings.append(None if loads is None else parse_loadings(loads, links[-1]["weight"],
                                                                  f"the link {ends} of {where}", crossed, n_heads))
        if loadings[-1]:
            n_heads = n_heads or len(loadings[-1][0]["heads"])  # the first loaded layer's, for every other link
        if loadings[-1] is not None:
            links[-1]["heads"] = compact_loadings(loadings[-1])
    drivers, computed = node_drivers(nodes, links)
    for node, found in zip(nodes, drivers, strict=True):
        node["drivers"] = found
    page = jsonable({"metadata": {"prompt": str(meta.get("prompt") or "".join(tokens)), "prompt_tokens": tokens,
                                  "slug": meta.get("slug"), "node_threshold": _number(meta.get("node_threshold")),
                                  "info": {k: info[k] for k in INFO_SHOWN if k in info},
                                  "kept_share": KEPT_SHARE_MEANING,
                                  "drivers": {"k": DRIVERS, "computed": computed, "meaning": DRIVERS_MEANING},
                                  "heads": {**head_ranking(nodes, links, loadings),
                                            "effects": head_effect_rows(info, nodes, n_layers, n_heads, where)},
                                  "target": target_panel(info, tokens, {n["id"]: n["clerp"] for n in nodes
                                                                        if n["type"] == LOGIT}, where)},
                     "nodes": nodes, "links": links})
    link_attention(page, {}, str(meta.get("slug") or "graph"))  # each head's command; a GraphFile adds its pages
    qparams = graph.get("qParams")
    return pinned_page(grouped_page(page, qparams.get("supernodes") if isinstance(qparams, dict) else None, where),
                       qparams, where)
