"""Phi3 (Phi-4, Phi-4-mini): fused ``qkv_proj`` split [q | k | v] and fused
``gate_up_proj`` chunked into (gate, up); partial rotary, irrelevant once the attention
probabilities are frozen. Residual dropouts are identities in eval mode. Two detach
conventions: ``up`` (default, like every family) and ``gate``, the reference implementation's
(``up(x)`` and ``sigmoid(gate(x))`` frozen, the linear path through ``gate``)."""

from transformers.models.phi3 import modeling_phi3 as m

from .base import Family, MlpRule, NormRule

FAMILY = Family(
    name="Phi3",
    model_types=("phi3",),
    norms=(NormRule(m.Phi3RMSNorm),),
    mlps=(MlpRule(m.Phi3MLP, act="activation_fn", fused=True),),
    attentions=(m.Phi3Attention,),
    containers=(m.Phi3Model, m.Phi3DecoderLayer),
    position_modules=(m.Phi3RotaryEmbedding,),
    # qkv_proj is not frozen: its value slice is on the linear path, so it is checked.
    attention_frozen_children=frozenset(),
    # the paper's reference implementation keeps Phi's linear path through gate (SiLU(g) = g * sigmoid(g))
    conventions=("up", "gate"),
)
