"""OLMoE: OLMo-style QK-norm across all heads with sparse mixture-of-experts MLPs.

``config.clip_qkv`` clamps the values inside the attention forward, a nonlinearity on the
path that no module exposes, so a model with it set is refused (the released OLMoE
checkpoints leave it unset).
"""

from typing import Any

from transformers.models.olmoe import modeling_olmoe as m

from .base import Family, MlpRule, MoeRule, NormRule


def _config_problem(config: Any) -> str | None:
    if getattr(config, "clip_qkv", None) is not None:
        return f"clip_qkv={config.clip_qkv} clamps the attention values (a nonlinearity with no detach rule)"
    return None


FAMILY = Family(
    name="OLMoE",
    model_types=("olmoe",),
    norms=(NormRule(m.OlmoeRMSNorm),),
    mlps=(MlpRule(m.OlmoeMLP),),
    moes=(MoeRule(m.OlmoeSparseMoeBlock),),
    attentions=(m.OlmoeAttention,),
    containers=(m.OlmoeModel, m.OlmoeDecoderLayer),
    position_modules=(m.OlmoeRotaryEmbedding,),
    config_problem=_config_problem,
    streamable=False,
)
