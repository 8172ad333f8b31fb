"""Which weight source a model gets: a loaded model's own tensors, a GGUF file, or a folder's safetensors."""

from __future__ import annotations

from typing import Any

from torch import nn

from .gguf import GGUFWeights
from .weights import ModuleWeights, SafetensorsWeights, WeightSource


def open_source(source: Any, config: dict[str, Any] | None = None, model_config: Any = None, *,
                gguf: bool = False) -> WeightSource:
    """A :class:`~detjac.engine.checkpoints.weights.WeightSource` for a loaded model, a GGUF file (``gguf``;
    ``model_config``, its transformers config, maps its tensor names) or a checkpoint folder (``config``, its
    config.json, says whether it is quantized)."""
    if isinstance(source, nn.Module):
        return ModuleWeights(source)
    if gguf:
        return GGUFWeights.for_config(source, model_config)
    return SafetensorsWeights(source, config)
