"""Gemma3 (text): sandwich norms with ``1 + w`` weights, per-head QK norms, GeGLU, a sqrt(d) embedding scale and
sliding-window layers from ``config.layer_types``.

The multimodal checkpoints' text path (``model.model.language_model``) is the same model, and the Jacobian is of that
path only. Details: docs/engine.md, "Families"."""

from torch import nn
from transformers.models.gemma3 import modeling_gemma3 as m

from .base import Family, MlpRule, NormRule


def _text_decoder(model: nn.Module) -> nn.Module:
    """The Gemma3TextModel: ``model.model`` (text-only) or ``model.model.language_model``."""
    base = model.get_submodule("model")
    return base.get_submodule("language_model") if hasattr(base, "language_model") else base


FAMILY = Family(
    name="Gemma3",
    model_types=("gemma3_text", "gemma3"),
    norms=(NormRule(m.Gemma3RMSNorm, eps_attr="eps", weight_offset=1.0),),
    mlps=(MlpRule(m.Gemma3MLP),),
    attentions=(m.Gemma3Attention,),
    containers=(m.Gemma3TextModel, m.Gemma3DecoderLayer),
    position_modules=(m.Gemma3RotaryEmbedding,),
    decoder=_text_decoder,
    mid_residual="pre_feedforward_layernorm",
)
