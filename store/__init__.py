"""Chunked Zarr store for detached Jacobians (zarr v3; never imports torch).

Not implemented yet: the store layout, writer and query API are specified in the
project's issue tracker ("Chunked Zarr store") and land in a later change.
"""
