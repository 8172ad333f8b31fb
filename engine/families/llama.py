"""Llama (3.x): pre-norm RMSNorm, SwiGLU MLP, grouped-query attention with RoPE."""

from transformers.models.llama import modeling_llama as m

from .base import Family, MlpRule, NormRule

FAMILY = Family(
    name="Llama",
    model_types=("llama",),
    norms=(NormRule(m.LlamaRMSNorm),),
    mlps=(MlpRule(m.LlamaMLP),),
    attentions=(m.LlamaAttention,),
    containers=(m.LlamaModel, m.LlamaDecoderLayer),
    position_modules=(m.LlamaRotaryEmbedding,),
)
