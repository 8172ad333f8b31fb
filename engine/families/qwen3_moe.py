"""Qwen3-MoE: Qwen3's attention (per-head QK-norm) with sparse mixture-of-experts MLPs.

Each MoE block's router choice and weights are frozen and each chosen expert's gated MLP
is detached as usual (:mod:`detjac.engine.detach.moe`). Layers listed in ``mlp_only_layers`` (or
off the ``decoder_sparse_step``) keep a dense gated MLP.
"""

from transformers.models.qwen3_moe import modeling_qwen3_moe as m

from .base import Family, MlpRule, MoeRule, NormRule

FAMILY = Family(
    name="Qwen3-MoE",
    model_types=("qwen3_moe",),
    norms=(NormRule(m.Qwen3MoeRMSNorm),),
    mlps=(MlpRule(m.Qwen3MoeMLP),),
    moes=(MoeRule(m.Qwen3MoeSparseMoeBlock),),
    attentions=(m.Qwen3MoeAttention,),
    containers=(m.Qwen3MoeModel, m.Qwen3MoeDecoderLayer),
    position_modules=(m.Qwen3MoeRotaryEmbedding,),
    streamable=False,
)
