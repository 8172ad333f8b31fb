"""The layer-streamed engine: one decoder layer in memory at a time, for models larger than the compute device,
layerwise targets and memory budgets (the skeleton, the trace, the reverse and forward passes, the cost model)."""
