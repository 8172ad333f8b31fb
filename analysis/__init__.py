"""Analyses of detached Jacobians on numpy / dask arrays (no torch at module level).

``plots``: matplotlib figures (singular value spectra). The dask analyses that read the
store (SVD, decoding, layerwise emergence, steering) land after the store.
"""
