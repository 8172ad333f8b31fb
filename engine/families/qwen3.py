"""Qwen3: Llama layout plus per-head RMSNorm on queries and keys (QK-norm).

The QK norms feed only the attention scores, which are frozen, so they need no rule.
A sliding window, when ``use_sliding_window`` is set, reaches layers through the mask.
"""

from transformers.models.qwen3 import modeling_qwen3 as m

from .base import Family, MlpRule, NormRule

FAMILY = Family(
    name="Qwen3",
    model_types=("qwen3",),
    norms=(NormRule(m.Qwen3RMSNorm),),
    mlps=(MlpRule(m.Qwen3MLP),),
    attentions=(m.Qwen3Attention,),
    containers=(m.Qwen3Model, m.Qwen3DecoderLayer),
    position_modules=(m.Qwen3RotaryEmbedding,),
)
