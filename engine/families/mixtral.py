"""Mixtral: Mistral's attention (sliding window through the mask) with sparse mixture-of-experts
MLPs (top-2 of 8 in the released models). Router jitter is applied in training only."""

from transformers.models.mixtral import modeling_mixtral as m

from .base import Family, MoeRule, NormRule

FAMILY = Family(
    name="Mixtral",
    model_types=("mixtral",),
    norms=(NormRule(m.MixtralRMSNorm),),
    mlps=(),
    moes=(MoeRule(m.MixtralSparseMoeBlock),),
    attentions=(m.MixtralAttention,),
    containers=(m.MixtralModel, m.MixtralDecoderLayer),
    position_modules=(m.MixtralRotaryEmbedding,),
    streamable=False,
)
