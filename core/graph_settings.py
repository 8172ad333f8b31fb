"""The attribution graphs' defaults, in one place for the engine, the runs and the CLI (torch-free).

circuit-tracer's defaults, so that graphs compare: at most :data:`MAX_NODES` neurons enter the adjacency, and pruning
keeps the nodes holding :data:`NODE_THRESHOLD` and the edges holding :data:`EDGE_THRESHOLD` of the influence on the
logits (docs/graphs.md)."""

MAX_NODES = 7500  # neurons that enter the adjacency (circuit-tracer's default max_feature_nodes)
NODE_THRESHOLD = 0.8
EDGE_THRESHOLD = 0.98
