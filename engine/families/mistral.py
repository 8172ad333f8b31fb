"""Mistral and Ministral: Llama layout with a sliding window on every layer (via the mask)."""

from transformers.models.mistral import modeling_mistral as m

from .base import Family, MlpRule, NormRule

FAMILY = Family(
    name="Mistral",
    model_types=("mistral",),
    norms=(NormRule(m.MistralRMSNorm),),
    mlps=(MlpRule(m.MistralMLP),),
    attentions=(m.MistralAttention,),
    containers=(m.MistralModel, m.MistralDecoderLayer),
    position_modules=(m.MistralRotaryEmbedding,),
)
