"""OLMo2: no input norm; post-norms on each sublayer's output before the residual add;
QK-norm across all heads (before the head reshape), behind the frozen softmax."""

from transformers.models.olmo2 import modeling_olmo2 as m

from .base import Family, MlpRule, NormRule

FAMILY = Family(
    name="OLMo2",
    model_types=("olmo2",),
    norms=(NormRule(m.Olmo2RMSNorm),),
    mlps=(MlpRule(m.Olmo2MLP),),
    attentions=(m.Olmo2Attention,),
    containers=(m.Olmo2Model, m.Olmo2DecoderLayer),
    position_modules=(m.Olmo2RotaryEmbedding,),
    mid_residual="mlp",  # no pre-MLP norm: the MLP reads the residual itself
)
