"""detjac: exact detached Jacobians of language models, stored and analyzed at scale.

The package is split by layer (see README): :mod:`detjac.engine` (torch) computes,
:mod:`detjac.store` (zarr) persists, :mod:`detjac.analysis` (dask) analyzes and
:mod:`detjac.cli` (click) drives them. This top-level module stays dependency-free.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
