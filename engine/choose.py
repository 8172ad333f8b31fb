"""Which engine: a loaded model wrapped as it is, or a checkpoint loaded into the engine the user's options ask for."""

from __future__ import annotations

from typing import Any

from .backend import Engine
from .inmemory import InMemoryEngine
from .loading import load_model
from .streamed import StreamedModel


def as_engine(model: Any, *, detach: bool = True, tokenizer: Any | None = None,
              forward: str = "transpose") -> Engine:
    """``model`` if it is an engine already, else a loaded transformers model wrapped in the in-memory engine."""
    if isinstance(model, Engine):
        return model
    return InMemoryEngine(model, detach=detach, tokenizer=tokenizer, forward=forward)


def load_engine(source: Any, *, streamed: bool = False, dtype: Any = None, device: str = "cpu",
                detach: bool = True, max_memory: str | dict[str, int] | None = None, quantize: str | None = None,
                revision: str | None = None, trust_remote_code: bool = False) -> Engine:
    """Load a checkpoint folder into an engine: the layer-streamed one when ``streamed`` (or a memory budget, or
    quantizing on load, which only it does), else the in-memory one.

    Parameters
    ----------
    source
        A checkpoint folder or a Hugging Face hub id ``org/name`` (see :func:`load_model`).
    dtype
        Compute dtype (default float64, the exactness mode).
    max_memory
        Budgets per device (``"cuda:0=8GiB,cpu=32GiB"``); the streamed engine sizes its blocks to them.
    """
    import torch

    dtype = torch.float64 if dtype is None else dtype
    if streamed or max_memory or quantize:
        return StreamedModel(source, dtype=dtype, device=device, detach=detach, max_memory=max_memory,
                             quantize=quantize, revision=revision, trust_remote_code=trust_remote_code)
    model = load_model(source, dtype=dtype, device=device, revision=revision, trust_remote_code=trust_remote_code)
    return InMemoryEngine(model, detach=detach)
