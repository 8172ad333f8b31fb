"""What the layer-streamed engine reads of a model source before it streams anything: the config and model class,
whether the family streams, whether a quantization asked for applies, and the tokenizer. A checkpoint folder, a GGUF
file or an already loaded model; nothing here reads weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from detjac.errors import InvalidArgumentError, UnsupportedModelError

from ..checkpoints.loading import read_checkpoint
from ..checkpoints.reference import ModelRef
from ..families import family_for


def model_class(source: ModelRef | nn.Module, revision: str | None,
                trust_remote_code: bool) -> tuple[Any, type, Any, Path | None]:
    """(config, model class, raw config.json or None, checkpoint folder or GGUF file, or None) of a checkpoint or
    loaded model."""
    if isinstance(source, nn.Module):
        return source.config, type(source), None, None
    from transformers import AutoModelForCausalLM

    path, raw = read_checkpoint(source, revision)
    if source.is_gguf:
        from ..checkpoints.gguf import gguf_config

        config = gguf_config(path)
    else:
        from ..checkpoints.loading import parse_config

        config = parse_config(path, revision, trust_remote_code)
    return config, AutoModelForCausalLM._model_mapping[type(config)], raw, path


def streamable_family(config: Any) -> Any:
    family = family_for(config)
    if not family.streamable:
        kind = "affine: biases or position embeddings" if family.affine else "mixture of experts"
        raise UnsupportedModelError(
            f"Expected a model the layer-streamed engine supports (bias-free, dense, causal). Got a "
            f"{family.name} model ({kind}{', encoder' if family.encoder else ''}), which it would "
            "not linearize correctly. "
            "Use the in-memory engine (detjac run without --streamed, --layers or --max-memory)."
        )
    return family


def check_quantize(quantize: str | None, already: str | None) -> None:
    if quantize is None:
        return
    from ..checkpoints.quantized import QUANT_METHODS

    if quantize not in QUANT_METHODS:
        raise InvalidArgumentError(f"Expected quantize one of {', '.join(QUANT_METHODS)}. Got {quantize!r}.")
    if already:
        raise InvalidArgumentError(
            f"Expected a float checkpoint to quantize on load. Got one already quantized ({already})."
        )


def load_tokenizer(source: Path | nn.Module, gguf: bool, revision: str | None, trust_remote_code: bool) -> Any | None:
    """The tokenizer of a loaded model, a GGUF file (``gguf``) or a checkpoint folder (as :func:`model_class` found
    them)."""
    if isinstance(source, nn.Module):
        from ..checkpoints.loading import get_tokenizer

        return get_tokenizer(source)
    if gguf:
        from ..checkpoints.gguf import gguf_tokenizer

        return gguf_tokenizer(source)
    from ..checkpoints.loading import load_tokenizer

    return load_tokenizer(source, revision, trust_remote_code)
