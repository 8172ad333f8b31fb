"""Gemma 2: Gemma3's layout without QK norms, with soft-capping.

Sandwich norms (four per layer) with ``1 + w`` weights, GeGLU (tanh GELU gate), embeddings
scaled by sqrt(d) inside the embedding module, attention scale
``query_pre_attn_scalar ** -0.5``, sliding-window layers chosen by ``config.layer_types``.
Attention-logit soft-capping ``c tanh(s / c)`` acts on the scores inside the softmax, so it
is frozen with the attention probabilities; final-logit soft-capping acts after the hidden
state and is the scalar nonlinearity ``z * (c tanh(z / c) / z)`` of
:func:`detjac.engine.detach.activations.softcap_ratio` in the logit Jacobian.
"""

from transformers.models.gemma2 import modeling_gemma2 as m

from .base import Family, MlpRule, NormRule

FAMILY = Family(
    name="Gemma2",
    model_types=("gemma2",),
    norms=(NormRule(m.Gemma2RMSNorm, eps_attr="eps", weight_offset=1.0),),
    mlps=(MlpRule(m.Gemma2MLP),),
    attentions=(m.Gemma2Attention,),
    containers=(m.Gemma2Model, m.Gemma2DecoderLayer),
    position_modules=(m.Gemma2RotaryEmbedding,),
    mid_residual="pre_feedforward_layernorm",
)
