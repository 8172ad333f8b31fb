"""GPT-2: pre-norm LayerNorm (mean subtracted, biased), fused biased ``Conv1D`` projections, an ungated GELU MLP and
learned absolute position embeddings.

Affine: the biases and the position embeddings are in the offset ``b``, and the Jacobian is with respect to the token
embeddings ``wte(ids)``. Details: docs/engine.md, "Families"."""

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
