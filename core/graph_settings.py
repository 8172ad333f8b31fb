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
