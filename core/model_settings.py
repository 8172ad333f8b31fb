"""How a command loads its model, in one place for the engine, the runs and the CLI (torch-free).

:class:`ModelSettings` holds the options every model-loading command shares (``--dtype``, ``--device``,
``--streamed``, ``--max-memory``, ...), which the CLI's ``ModelOptions``, the run's ``RunOptions`` and the workers'
``ModelSpec`` extend; :func:`wants_streamed` decides when the layer-streamed engine is implied."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


def wants_streamed(streamed: bool, max_memory: Any = None, quantize: str | None = None) -> bool:
    """Whether a model loads into the layer-streamed engine: asked for, or implied by a memory budget (only it sizes
    its blocks to one) or by quantizing on load (only it quantizes)."""
    return bool(streamed or max_memory or quantize)


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    """How a process loads a model: the compute ``dtype`` (a torch dtype's name) and ``device``; the layer-streamed
    engine (``streamed``, implied by ``max_memory`` and ``quantize``: :attr:`streamed_engine`); per-device budgets
    (``max_memory``, ``"cuda:0=8GiB,cpu=32GiB"``); a hub id's ``revision``; ``trust_remote_code``; ``detach``
    (False: the ordinary Jacobian); ``quantize`` on load (nf4, fp4, int8); the family's detach ``convention`` (None:
    its default)."""

    dtype: str = "float64"
    device: str = "cpu"
    streamed: bool = False
    max_memory: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    detach: bool = True
    quantize: str | None = None
    convention: str | None = None

    @property
    def streamed_engine(self) -> bool:
        """Whether these settings load the layer-streamed engine (:func:`wants_streamed`)."""
        return wants_streamed(self.streamed, self.max_memory, self.quantize)

    def model_settings(self) -> dict[str, Any]:
        """These settings alone (not a subclass's other fields), by name: to build another kind of settings."""
        return {f.name: getattr(self, f.name) for f in fields(ModelSettings)}
