"""Gemma 2: Gemma3's layout without QK norms, with soft-capping.

The attention-logit cap is frozen with the attention probabilities; the final-logit cap is the scalar nonlinearity of
:func:`detjac.engine.detach.activations.softcap_ratio` in the logit Jacobian. Details: docs/engine.md, "Families"."""

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
