"""Qwen2 (and Qwen2.5): Llama layout with biased Q, K and V projections.

The Q and K biases feed only the frozen attention probabilities; the V bias stays on the
path, so the detached map is affine (``y = sum_k J_k x_k + b``) and ``b`` carries it.
A sliding window, when ``use_sliding_window`` is set, reaches layers through the mask.
"""

from transformers.models.qwen2 import modeling_qwen2 as m

from .base import Family, MlpRule, NormRule

FAMILY = Family(
    name="Qwen2",
    model_types=("qwen2",),
    norms=(NormRule(m.Qwen2RMSNorm),),
    mlps=(MlpRule(m.Qwen2MLP),),
    attentions=(m.Qwen2Attention,),
    containers=(m.Qwen2Model, m.Qwen2DecoderLayer),
    position_modules=(m.Qwen2RotaryEmbedding,),
    affine=True,
    streamable=False,
)
