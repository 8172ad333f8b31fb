"""Family adapters, one file per family, registered by ``config.model_type``.

Adding a family is adding one file that defines ``FAMILY`` and its line in ``_FILES`` below. A file is imported
when its family is first asked for (each imports its transformers modeling module: all thirteen cost 0.2 s of
start-up), so the table names each file's ``model_types`` (a test checks them against the files).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from detjac.errors import UnsupportedModelError

from .base import Family, MlpRule, MoeRule, NormRule

_FILES: dict[str, tuple[str, ...]] = {  # file -> its FAMILY.model_types
    "llama": ("llama",), "qwen3": ("qwen3",), "gemma3": ("gemma3_text", "gemma3"), "phi3": ("phi3",),
    "mistral": ("mistral",), "olmo2": ("olmo2",), "gemma2": ("gemma2",),  # linear: bias-free, gated
    "qwen2": ("qwen2",), "gpt2": ("gpt2",), "bert": ("bert",),  # affine: biases, LayerNorm, learned positions
    "qwen3_moe": ("qwen3_moe",), "mixtral": ("mixtral",), "olmoe": ("olmoe",),  # mixture of experts
}


class _Families(Mapping[str, Family]):
    """``model_type -> Family``, importing a family's file on first access."""

    def __init__(self) -> None:
        self._file = {model_type: name for name, types in _FILES.items() for model_type in types}

    def __getitem__(self, model_type: str) -> Family:
        name = self._file[model_type]  # KeyError for an unknown type, as a dict
        return importlib.import_module(f"{__name__}.{name}").FAMILY

    def __iter__(self) -> Iterator[str]:
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)


FAMILIES: Mapping[str, Family] = _Families()


def supported_model_types() -> list[str]:
    """Sorted ``config.model_type`` values that have a detach rule set."""
    return sorted(FAMILIES)


def family_for(config: object) -> Family:
    """The adapter for a transformers config.

    Raises
    ------
    UnsupportedModelError
        If ``config.model_type`` has no adapter; the message lists the supported ones.
    """
    model_type = getattr(config, "model_type", None)
    try:
        return FAMILIES[model_type]  # type: ignore[index]
    except (KeyError, TypeError):
        raise UnsupportedModelError(
            f"Expected a model of a supported family (config.model_type one of "
            f"{', '.join(supported_model_types())}). Got model_type={model_type!r} instead. "
            "A family needs a detach rule file under engine/families/ before its Jacobian "
            "can be trusted."
        ) from None


__all__ = ["FAMILIES", "Family", "MlpRule", "MoeRule", "NormRule", "family_for", "supported_model_types"]
