"""Chunked Zarr store for detached Jacobians (zarr v3; never imports torch).

>>> from detjac.store import open_store
>>> store = open_store("run.zarr")                       # doctest: +SKIP
>>> [p.prompt for p in store.prompts(contains="cat")]     # doctest: +SKIP
>>> store.get(store.prompt_ids()[0]).jacobian()           # lazy dask array (row, token, col)  # doctest: +SKIP

The format is specified in ``docs/store-format.md``.
"""

from .base import JacobianStore, LayerwiseSpec, PromptWriter, StoredPrompt, VerifyResult
from .format import FORMAT_VERSION, NO_JACOBIAN, model_differences, prompt_id
from .zarr_create import create_store
from .zarr_prompt import ZarrPrompt, verify_prompt
from .zarr_store import ZarrStore, attach_store, open_store
from .zarr_writer import ZarrPromptWriter

__all__ = [
    "NO_JACOBIAN",
    "FORMAT_VERSION",
    "JacobianStore",
    "LayerwiseSpec",
    "PromptWriter",
    "StoredPrompt",
    "VerifyResult",
    "ZarrPrompt",
    "ZarrPromptWriter",
    "ZarrStore",
    "attach_store",
    "create_store",
    "model_differences",
    "open_store",
    "prompt_id",
    "verify_prompt",
]
