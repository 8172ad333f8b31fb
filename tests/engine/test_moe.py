"""Mixture-of-experts families: router choice and weights frozen, each chosen expert detached."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES

from detjac.engine import InMemoryEngine, jacobian
from detjac.engine.checkpoints.tiny import tiny_config, tiny_model
from detjac.engine.detach.factors import FactorTape
from detjac.engine.detach.model import linearized
from detjac.engine.families import family_for
from detjac.engine.streamed.streamed_engine import StreamedEngine
from detjac.errors import UnsupportedModelError

MOE = [t for t in FAMILIES if family_for(tiny_config(t)).moes]


def test_moe_families_are_under_test():
    assert set(MOE) == {"qwen3_moe", "mixtral", "olmoe"}


@pytest.mark.parametrize("model_type", MOE)
def test_two_of_four_experts_per_token_and_every_expert_used(model_type, prompt_ids):
    model = tiny_model(model_type, seed=7)
    tape = FactorTape()
    with linearized(model) as lin, torch.no_grad(), tape.recording():
        lin.decoder(input_ids=torch.tensor([prompt_ids]))
    routes = [f for f in tape.factors if isinstance(f, tuple)]  # (weights, chosen) per MoE block
    assert routes
    per_block = []
    for weights, chosen in routes:
        assert chosen.shape == (len(prompt_ids), 2) and weights.shape == chosen.shape
        assert torch.all(chosen[:, 0] != chosen[:, 1]) and torch.all(weights > 0)
        per_block.append(set(chosen.unique().tolist()))
    assert {0, 1, 2, 3} in per_block  # tokens of one block spread over all four experts
    assert jacobian(InMemoryEngine(model), prompt_ids).reconstruction_error < 1e-12


def test_olmoe_value_clipping_is_refused(prompt_ids):
    with pytest.raises(UnsupportedModelError, match="clip_qkv=0.5 clamps the attention values"):
        jacobian(InMemoryEngine(tiny_model("olmoe", clip_qkv=0.5)), prompt_ids)


def test_unknown_expert_layout_is_refused(prompt_ids):
    model = tiny_model("mixtral")
    model.model.layers[0].mlp.experts.is_transposed = True
    with pytest.raises(UnsupportedModelError, match="is_transposed=True"):
        jacobian(InMemoryEngine(model), prompt_ids)


@pytest.mark.parametrize("model_type", MOE)
def test_streamed_engine_refuses_moe(model_type):
    with pytest.raises(UnsupportedModelError, match=r"layer-streamed engine.*mixture of experts"):
        StreamedEngine(tiny_model(model_type), dtype=torch.float64)
