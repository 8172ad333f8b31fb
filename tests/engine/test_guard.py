"""The guard refuses anything it cannot prove linear, naming the module and its path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from detjac.engine import InMemoryEngine, jacobian
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.engine.detach.model import linearized
from detjac.errors import DetjacError, LinearizationError, UnsupportedModelError


def test_unknown_model_type_lists_supported(prompt_ids):
    from transformers import OPTConfig, OPTForCausalLM

    model = OPTForCausalLM(OPTConfig(num_hidden_layers=1, hidden_size=16, ffn_dim=32, word_embed_proj_dim=16,
                                     num_attention_heads=2, vocab_size=160))
    with pytest.raises(UnsupportedModelError) as e:
        jacobian(InMemoryEngine(model), prompt_ids)
    msg = str(e.value)
    assert "model_type='opt'" in msg
    for mt in ("bert", "gemma3_text", "gpt2", "llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3"):
        assert mt in msg


def test_injected_activation_is_named(prompt_ids):
    model = tiny_model("llama")
    lin = model.model.layers[1].self_attn.o_proj
    model.model.layers[1].self_attn.o_proj = nn.Sequential(lin, nn.Tanh())
    with pytest.raises(UnsupportedModelError, match=r"Tanh at model\.layers\.1\.self_attn\.o_proj\.1"):
        jacobian(InMemoryEngine(model), prompt_ids)


def test_unknown_norm_is_named(prompt_ids):
    model = tiny_model("qwen3")
    model.model.layers[0].post_attention_layernorm = nn.LayerNorm(32, dtype=torch.float64)
    with pytest.raises(UnsupportedModelError, match=r"LayerNorm at model\.layers\.0\.post_attention_layernorm"):
        jacobian(InMemoryEngine(model), prompt_ids)


def test_biased_linear_is_refused(prompt_ids):
    model = tiny_model("mistral")
    mlp = model.model.layers[2].mlp
    mlp.down_proj.bias = nn.Parameter(torch.zeros(32, dtype=torch.float64))
    with pytest.raises(UnsupportedModelError, match=r"biased Linear at model\.layers\.2\.mlp\.inner\.down_proj"):
        jacobian(InMemoryEngine(model), prompt_ids)


def test_subclassed_block_is_refused(prompt_ids):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class Custom(LlamaDecoderLayer):
        pass

    model = tiny_model("llama")
    model.model.layers[0].__class__ = Custom
    with pytest.raises(UnsupportedModelError, match=r"Custom at model\.layers\.0"):
        jacobian(InMemoryEngine(model), prompt_ids)


def test_frozen_branch_may_hold_any_activation(prompt_ids):
    # act(gate(x)) is frozen whatever act is, so swapping it keeps the map exact.
    model = tiny_model("olmo2")
    model.model.layers[0].mlp.act_fn = nn.Tanh()
    assert jacobian(InMemoryEngine(model), prompt_ids).reconstruction_error < 1e-12


def test_model_restored_when_guard_refuses(prompt_ids):
    model = tiny_model("phi3")
    model.model.layers[0].mlp.down_proj = nn.Sequential(model.model.layers[0].mlp.down_proj, nn.GELU())
    norm_cls = type(model.model.norm)
    with pytest.raises(UnsupportedModelError):
        with linearized(model):
            pass
    assert type(model.model.norm) is norm_cls
    assert model.config._attn_implementation == "sdpa"


def test_nonlinearity_outside_modules_is_caught_by_reconstruction(prompt_ids):
    # A nonlinearity hidden in a forward (no module to inspect) escapes the structural
    # guard; the float64 reconstruction check must still refuse the result.
    model = tiny_model("llama")
    layer = model.model.layers[0]
    original = layer.forward
    layer.forward = lambda *a, **k: torch.tanh(original(*a, **k))
    with pytest.raises(LinearizationError, match="escaped the Llama detach rules") as e:
        jacobian(InMemoryEngine(model), prompt_ids)
    assert isinstance(e.value, DetjacError) and isinstance(e.value, RuntimeError)
    assert jacobian(InMemoryEngine(model), prompt_ids, check=False).reconstruction_error > 1e-6
