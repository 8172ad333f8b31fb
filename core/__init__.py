"""detjac: exact detached Jacobians of language models, stored and analyzed at scale.

The package is split by layer (see ``docs/engine.md``, "Layout"): :mod:`detjac.engine` (torch)
computes, :mod:`detjac.store` (zarr) persists, :mod:`detjac.analysis` (dask) analyzes,
:mod:`detjac.runs` orchestrates and :mod:`detjac.cli` (click) drives them. The top-level
modules are torch-free homes for ideas every layer shares: :mod:`detjac.errors` (the error
hierarchy), :mod:`detjac.targets` (the target grammar), :mod:`detjac.exactness` (the relative
error and its bounds) and :mod:`detjac.singular` (how singular pairs are oriented).
"""

import warnings as _warnings

__version__ = "0.1.0"

# huggingface_hub imports tqdm.auto, which in a Jupyter kernel without ipywidgets warns "IProgress not found" and
# falls back to text bars. detjac's bars never take that path (detjac.progress), so the warning tells a user nothing.
_warnings.filterwarnings("ignore", message="IProgress not found")

__all__ = ["__version__"]
