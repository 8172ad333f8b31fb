"""Family adapters, one file per family, registered by ``config.model_type``.

Adding a family is adding one file that defines ``FAMILY`` and one line below.
"""

from __future__ import annotations

from types import ModuleType

from detjac.errors import UnsupportedModelError

from . import bert, gemma2, gemma3, gpt2, llama, mistral, mixtral, olmo2, olmoe, phi3, qwen2, qwen3, qwen3_moe
from .base import Family, MlpRule, MoeRule, NormRule

_MODULES: tuple[ModuleType, ...] = (
    llama, qwen3, gemma3, phi3, mistral, olmo2, gemma2,  # linear: bias-free, gated
    qwen2, gpt2, bert,  # affine: biases, LayerNorm, ungated activations, learned positions
    qwen3_moe, mixtral, olmoe,  # mixture of experts
)

FAMILIES: dict[str, Family] = {
    model_type: module.FAMILY for module in _MODULES for model_type in module.FAMILY.model_types
}


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
    except KeyError:
        raise UnsupportedModelError(
            f"Expected a model of a supported family (config.model_type one of "
            f"{', '.join(supported_model_types())}). Got model_type={model_type!r} instead. "
            "A family needs a detach rule file under engine/families/ before its Jacobian "
            "can be trusted."
        ) from None


__all__ = ["FAMILIES", "Family", "MlpRule", "MoeRule", "NormRule", "family_for", "supported_model_types"]
