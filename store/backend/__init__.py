"""The zarr v3 directory backend of the store interfaces: a store is a folder, a prompt a group renamed into place
when complete (``zarr_*``), with what keeps it crash-safe and checked (sealed groups, strict chunk reads, the writer
lock, failure records, durable file-system steps, verification). Specified in ``docs/store-format.md``."""
