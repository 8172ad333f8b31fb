"""Gemma3 (text): sandwich norms (four per layer) with ``1 + w`` weights, per-head QK
norms, GeGLU (tanh GELU gate), embeddings scaled by sqrt(d) inside the embedding module,
attention scale ``query_pre_attn_scalar ** -0.5`` and sliding-window layers chosen per
layer from ``config.layer_types`` (the window reaches a layer through its mask).

The released 4B/12B/27B checkpoints are multimodal (``model_type`` "gemma3",
``Gemma3ForConditionalGeneration``); their text path is the same ``Gemma3TextModel``,
reached as ``model.model.language_model``, and the Jacobian is of that path only."""

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
