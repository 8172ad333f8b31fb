"""detjac: exact detached Jacobians of language models, stored and analyzed at scale.

Split by layer: :mod:`detjac.engine` (torch) computes, :mod:`detjac.store` (zarr) persists, :mod:`detjac.analysis`
(dask) analyzes, :mod:`detjac.runs` orchestrates and :mod:`detjac.cli` drives them; the top-level modules are
torch-free homes for ideas every layer shares. Layout: docs/engine.md, "Layout"."""

import warnings as _warnings

__version__ = "0.1.0"

# huggingface_hub imports tqdm.auto, which in a Jupyter kernel without ipywidgets warns "IProgress not found" and
# falls back to text bars. detjac's bars never take that path (detjac.progress), so the warning tells a user nothing.
_warnings.filterwarnings("ignore", message="IProgress not found")

__all__ = ["__version__"]
