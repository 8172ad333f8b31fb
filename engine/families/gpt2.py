"""GPT-2: pre-norm LayerNorm (mean subtracted, biased), fused biased ``Conv1D`` projections,
an ungated GELU MLP (``gelu_new``, the tanh approximation, by default) and learned
absolute position embeddings.

Every projection has a bias, so the detached map is affine: ``y = sum_k J_k x_k + b``.
The Jacobian is taken with respect to the token embeddings ``wte(ids)``; the position
embeddings ``wpe`` are added inside the model whatever the input, so they are part of
``b`` (a token's ``x_k`` stays decodable through the vocabulary). The fused ``c_attn``
projection is walked as a whole: its value slice is on the path.
"""

from torch import nn
from transformers.models.gpt2 import modeling_gpt2 as m

from .base import Family, NormRule

FAMILY = Family(
    name="GPT-2",
    model_types=("gpt2",),
    norms=(NormRule(nn.LayerNorm, eps_attr="eps", center=True),),
    mlps=(),
    attentions=(m.GPT2Attention,),
    containers=(m.GPT2Model, m.GPT2Block, m.GPT2MLP),
    position_modules=(),
    attention_frozen_children=frozenset(),
    decoder=lambda model: model.transformer,
    layers=lambda decoder: decoder.h,
    mid_residual="ln_2",
    affine=True,
    offset_children=frozenset({"wpe"}),
    streamable=False,
)
