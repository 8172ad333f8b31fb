"""Dask analyses that read stored Jacobians (SVD, decoding, layerwise emergence, steering).

Not implemented yet: the analyses read the store's public API and land after it.
"""
