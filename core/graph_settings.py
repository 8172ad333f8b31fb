"""The attribution graphs' defaults, and what their kept share means, in one place for the engine, the runs, the
CLI and the viewer (torch-free).

circuit-tracer's defaults, so that graphs compare: at most :data:`MAX_NODES` neurons enter the adjacency, and pruning
keeps the nodes holding :data:`NODE_THRESHOLD` and the edges holding :data:`EDGE_THRESHOLD` of the influence on the
logits (docs/graphs.md)."""

from typing import Any

from detjac.errors import InvalidArgumentError

MAX_NODES = 7500  # neurons that enter the adjacency (circuit-tracer's default max_feature_nodes)
NODE_THRESHOLD = 0.8
EDGE_THRESHOLD = 0.98

# What `metadata.info.logit_share_kept` is (engine/tools/graph_json.py computes it), said the same way by
# `detjac graph` and the graph page.
KEPT_SHARE_MEANING = (
    "Kept share of a logit: the sum of the direct edges from the graph's kept nodes into it, divided by its value "
    "(the demeaned logit). Every source of the model, kept or not, sums exactly to that value, so 1 - share is "
    "what the neurons left out of the graph (pruned, or never ranked into it) put there directly. A negative share "
    "means the kept nodes together push the logit down (their edges sum to the opposite sign of its value) and the "
    "left-out neurons carry more than all of it; a share above 1 means the kept nodes overshoot and the left-out "
    "ones pull it back.")


def check_heads(heads: Any) -> int:
    """``--heads`` (links of a graph to split by attention head) as a non-negative integer.

    Raises
    ------
    InvalidArgumentError
        Anything else.
    """
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 0:
        raise InvalidArgumentError(f"Expected --heads to be a non-negative integer (links to split by attention "
                                   f"head). Got {heads!r}.")
    return heads


def first_crossed(kind: str, layer: int | None) -> int | None:
    """The first attention layer a link from a node of ``kind`` (the JSON's ``feature_type``) crosses: layer 0 from a
    token (``embedding``), the next layer from a neuron of ``layer`` (after its MLP); None from anything else (a bias
    node's links carry no head loadings)."""
    if kind == "embedding":
        return 0
    return layer + 1 if kind == "mlp neuron" and layer is not None else None


def last_crossed(kind: str, layer: int | None, n_layers: int | None) -> int | None:
    """The last attention layer a link into a node of ``kind`` crosses: a neuron's own ``layer`` (its attention comes
    before its MLP), the model's last for a logit (None where ``n_layers`` is unknown); None for anything else."""
    if kind == "mlp neuron" and layer is not None:
        return layer
    return n_layers - 1 if kind == "logit" and n_layers is not None else None


def crossed_layers(source: tuple[str, int | None], target: tuple[str, int | None],
                   n_layers: int | None) -> range | None:
    """The attention layers a graph's link crosses (docs/graphs.md, "Head loadings"): from :func:`first_crossed` of
    its source to :func:`last_crossed` of its target, inclusive.

    Parameters
    ----------
    source, target : tuple of (str, int or None)
        Each end's node kind (the JSON's ``feature_type``: ``embedding``, ``mlp neuron``, ``logit``, ``bias``) and
        layer (a neuron's; None for the others).
    n_layers : int or None
        The model's layer count (None where unknown).

    Returns
    -------
    range or None
        The layers, empty for a link that crosses none (a last-layer neuron into a logit; a link from a bias node);
        None when it depends on the unknown ``n_layers`` (a link into a logit).
    """
    first, last = first_crossed(*source), last_crossed(*target, n_layers)
    if first is not None and target[0] == "logit" and n_layers is None:
        return None
    return range(0) if first is None or last is None else range(first, max(first, last + 1))
