"""BERT encoders (MiniLM, sentence-transformers checkpoints): post-norm LayerNorms, biases, an ungated GELU MLP,
bidirectional attention, learned position and token-type embeddings (in the offset ``b``).

The target is the final hidden state at position 0 ([CLS]) by default; with no language-model head, "logits" are
scores against the word embeddings. Details: docs/engine.md, "Families"."""

from torch import nn
from transformers.models.bert import modeling_bert as m

from .base import Family, NormRule

FAMILY = Family(
    name="BERT",
    model_types=("bert",),
    norms=(NormRule(nn.LayerNorm, eps_attr="eps", center=True),),
    mlps=(),
    attentions=(m.BertSelfAttention,),
    containers=(m.BertModel, m.BertEmbeddings, m.BertEncoder, m.BertLayer, m.BertAttention, m.BertSelfOutput,
                m.BertIntermediate, m.BertOutput),
    position_modules=(),
    attention_frozen_children=frozenset({"query", "key"}),
    decoder=lambda model: model.base_model,
    layers=lambda decoder: decoder.encoder.layer,
    mid_residual="intermediate",
    post_norm=True,
    affine=True,
    offset_children=frozenset({"position_embeddings", "token_type_embeddings"}),
    off_path_children=frozenset({"pooler"}),
    encoder=True,
    streamable=False,
)
