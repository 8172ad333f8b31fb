"""Chunked Zarr store for detached Jacobians (zarr v3; never imports torch).

>>> from detjac.store import open_store
>>> store = open_store("run.zarr")                       # doctest: +SKIP
>>> [p.prompt for p in store.prompts(contains="cat")]     # doctest: +SKIP
>>> store.get(store.prompt_ids()[0]).jacobian()           # lazy dask array (row, token, col)  # doctest: +SKIP

The interfaces are :class:`StoreReader` (what the analyses and the viewer read), :class:`StoreWriter` (what a run
writes through; ``JacobianStore`` is its earlier name), :class:`StoredPrompt` / :class:`PromptWriter` (one prompt)
and :class:`AnalysisCache` (where analyses keep their results); ``backend/`` implements them on a folder. The
format is specified in ``docs/store-format.md``.
"""

from .analysis_cache import AnalysisCache, MemoryAnalyses

# for runs/, view/, cli/ (the store's maintenance and export tools), not in __all__
from .backend.disk import npz_name, write_npz
from .backend.sealed import read_sealed, write_sealed
from .backend.zarr_create import create_store
from .backend.zarr_prompt import ZarrPrompt, verify_prompt
from .backend.zarr_store import ZarrStore, attach_store, open_store
from .backend.zarr_writer import ZarrPromptWriter
from .compare import StoreComparison, compare_stores
from .format import (
    FORMAT_VERSION,
    NO_JACOBIAN,
    SHARD_BYTES,
    Keep,
    model_differences,
    now,
    prompt_id,
    read_root,
    storage_dtype,
)
from .integrity import INTEGRITY, damage_reason
from .location import store_path
from .neuron_index import (
    NeuronIndex,
    NeuronIndexMismatch,
    commit_index,
    index_state,
    lock_path,
    open_neuron_index,
    start_index,
    writing_index,
)
from .neuron_stats import NeuronStats
from .reader import StoreReader, VerifyResult
from .stored_prompt import LayerwiseSpec, PromptWriter, StoredPrompt
from .subspace import SubspaceIteration
from .summary import export_graph, export_npz, listing, prompt_layout, store_summary, verify_summary
from .writer import JacobianStore, StoreWriter

__all__ = [
    "NO_JACOBIAN",
    "FORMAT_VERSION",
    "AnalysisCache",
    "JacobianStore",
    "Keep",
    "LayerwiseSpec",
    "MemoryAnalyses",
    "PromptWriter",
    "StoreComparison",
    "StoreReader",
    "StoreWriter",
    "StoredPrompt",
    "VerifyResult",
    "ZarrPrompt",
    "ZarrPromptWriter",
    "ZarrStore",
    "attach_store",
    "compare_stores",
    "create_store",
    "model_differences",
    "open_store",
    "prompt_id",
    "storage_dtype",
    "verify_prompt",
]
