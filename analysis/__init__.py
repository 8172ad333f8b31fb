"""Analyses of detached Jacobians on numpy / dask arrays (no torch at module level).

``spectra``: singular triplets, decoding and dimensionality of one stored operator;
``jobs``: those mapped over a store's prompts, results kept in the store; ``layers``: the
layerwise decomposition (layer table, emergence, heatmaps); ``compare``: detached against
ordinary Jacobians; ``plots``: matplotlib figures. The reports behind ``detjac analyze``
compose them and write tables and figures: ``decoded`` (svd, decode), ``jobs.dims_report``
(dims), ``layer_report`` (layers), ``compare.compare_report`` (compare), ``report`` (report).
"""
