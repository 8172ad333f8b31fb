"""BERT encoders (MiniLM, sentence-transformers checkpoints): post-norm LayerNorm (mean
subtracted, biased), biased linear layers, an ungated GELU (erf) MLP, bidirectional
attention, learned absolute position and token-type embeddings.

The operator maps the token embeddings ``word_embeddings(ids)`` to the final hidden state
at one position: by default position 0, the [CLS] token that sentence classifiers and
many pooling schemes read; any position can be asked for. Position and token-type
(segment 0) embeddings are added inside the model whatever the input, so they are part
of the offset ``b`` of the affine map ``y = sum_k J_k x_k + b``. The pooler (dense +
tanh on the [CLS] state) is not on the path to the hidden states and is not linearized.
The model is loaded with ``AutoModel``: there is no language-model head, and "logits"
are scores of the hidden state against the word embeddings.
"""

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
