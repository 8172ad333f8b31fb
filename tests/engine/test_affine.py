"""Affine families (biases, LayerNorm, ungated activations, learned positions): y = sum_k J_k x_k + b, exactly."""

from __future__ import annotations

import pytest
import torch
from tiny_models import AFFINE

from detjac.engine import InMemoryEngine, jacobian, prompt_pass
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.engine.detach.factors import FactorTape
from detjac.engine.detach.model import linearized
from detjac.engine.streamed.streamed_engine import StreamedEngine
from detjac.errors import UnsupportedModelError
from detjac.targets import OUTPUTS

STOCK_LOGIT_ATOL = 1e-5


@pytest.mark.parametrize("model_type", AFFINE)
def test_offset_uses_the_factors_of_the_real_input(model_type, prompt_ids):
    # b is the detached network on zero inputs with the factors of x frozen. Recomputing the
    # factors at zero gives another vector, which does not reconstruct the output.
    model = tiny_model(model_type, seed=7)
    res = jacobian(InMemoryEngine(model), prompt_ids)
    assert res.bias is not None and res.bias.shape == res.output.shape and res.bias.norm() > 0.1
    with linearized(model) as lin, torch.no_grad():
        zeros = torch.zeros_like(res.embeddings)[None]
        recomputed = lin.decoder(inputs_embeds=zeros).last_hidden_state[0, res.position]
    assert (recomputed - res.bias).norm() > 1e-3 * res.bias.norm()
    linear_part = torch.einsum("rnd,nd->r", res.jacobian, res.embeddings)
    assert (linear_part + recomputed - res.output).norm() > 1e-6 * res.output.norm()
    assert (linear_part + res.bias - res.output).norm() < 1e-12 * res.output.norm()
    assert (res.produced - linear_part).norm() < 1e-12 * res.output.norm()  # what singular vectors orient by


def test_linear_family_replays_to_exactly_zero(prompt_ids):
    # Bias-free: every op is homogeneous given the frozen factors, so the replayed pass on zeros is 0.
    model = tiny_model("gemma3_text", seed=7)
    with linearized(model) as lin, torch.no_grad():
        x = lin.decoder.get_input_embeddings()(torch.tensor([prompt_ids]))
        tape = FactorTape()
        with tape.recording():
            lin.decoder(inputs_embeds=x)
        with tape.replaying_factors():
            zero = lin.decoder(inputs_embeds=torch.zeros_like(x)).last_hidden_state
    assert len(tape.factors) > 0 and torch.count_nonzero(zero) == 0


@pytest.mark.parametrize("activation", ["gelu_new", "gelu", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu",
                                        "relu", "silu", "swish"])
def test_every_ungated_activation_is_exact(activation, prompt_ids):
    model = tiny_model("gpt2", seed=3, activation_function=activation)
    res = jacobian(InMemoryEngine(model), prompt_ids)
    assert res.reconstruction_error < 1e-12
    stock = InMemoryEngine(model).stock_logits(prompt_ids, -1)
    assert torch.allclose(res.logits, stock, rtol=0, atol=STOCK_LOGIT_ATOL)
    assert jacobian(InMemoryEngine(model, detach=False), prompt_ids).reconstruction_error > 1e-3


def test_encoder_targets_cls_and_sees_both_directions(prompt_ids):
    model = tiny_model("bert", seed=7)
    res = jacobian(InMemoryEngine(model), prompt_ids)
    assert res.position == 0
    assert torch.all(res.jacobian.abs().amax(dim=(0, 2)) > 0)  # every token reaches [CLS]: no causal mask
    inner = jacobian(InMemoryEngine(model), prompt_ids, position=5)
    with torch.no_grad():
        stock = model(torch.tensor([prompt_ids])).last_hidden_state[0]
    assert inner.reconstruction_error < 1e-12 and res.reconstruction_error < 1e-12
    assert torch.allclose(inner.output, stock[5], rtol=0, atol=1e-12)
    assert torch.allclose(res.output, stock[0], rtol=0, atol=1e-12)


def test_unknown_activation_in_an_affine_family_is_named(prompt_ids):
    model = tiny_model("gpt2", activation_function="relu2")
    with pytest.raises(UnsupportedModelError, match=r"ReLUSquaredActivation at transformer\.h\.0\.mlp\.act"):
        jacobian(InMemoryEngine(model), prompt_ids)
    bert = tiny_model("bert", hidden_act="mish")
    with pytest.raises(UnsupportedModelError, match=r"MishActivation at .*layer\.0\.intermediate\.intermediate_act_fn"):
        jacobian(InMemoryEngine(bert), prompt_ids)


def test_linear_family_still_refuses_biases_and_offsets(prompt_ids):
    model = tiny_model("llama")
    model.model.layers[0].self_attn.v_proj.bias = torch.nn.Parameter(torch.ones(16, dtype=torch.float64))
    with pytest.raises(UnsupportedModelError, match=r"biased Linear at model\.layers\.0\.self_attn\.v_proj.*Llama"):
        jacobian(InMemoryEngine(model), prompt_ids)


@pytest.mark.parametrize("model_type", AFFINE)
def test_streamed_engine_refuses_affine_families(model_type):
    with pytest.raises(UnsupportedModelError, match=r"layer-streamed engine.*affine"):
        StreamedEngine(tiny_model(model_type), dtype=torch.float64)


def test_stream_reconstruction_includes_the_offset(prompt_ids):
    products = prompt_pass(InMemoryEngine(tiny_model("qwen2")), prompt_ids, row_block=8)
    out = products.trace.output
    assert products.trace.bias is not None and products.trace.bias.norm() > 0
    assert torch.allclose(products.reconstructions[OUTPUTS], out, rtol=0, atol=1e-12 * out.norm())
