"""The one scalar-nonlinearity helper: f(z) = z * r(z) for activations and soft-capping."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN

from detjac.engine import InMemoryEngine, jacobian
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.engine.detach.activations import activation_ratio, softcap_ratio
from detjac.engine.products.logits import logit_jacobian as logit_jacobian_of

Z = torch.cat([torch.linspace(-8, 8, 401, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_python", "gelu_python_tanh",
                                  "gelu_fast", "quick_gelu", "relu", "silu", "swish"])
def test_ratio_times_input_is_the_stock_activation(name):
    module = ACT2FN[name]
    assert torch.allclose(Z * activation_ratio(module)(Z), module(Z), rtol=0, atol=4e-15)


def test_torch_gelu_modes_and_unknown_activations():
    for mode in ("none", "tanh"):
        module = nn.GELU(approximate=mode)
        assert torch.allclose(Z * activation_ratio(module)(Z), module(Z), rtol=0, atol=4e-15)
    for module in (nn.Tanh(), ACT2FN["mish"], ACT2FN["relu2"], nn.LeakyReLU()):
        assert activation_ratio(module) is None, type(module).__name__


def test_softcap_ratio_is_finite_at_zero_and_differentiable():
    ratio = softcap_ratio(2.0)
    assert torch.allclose(Z * ratio(Z), 2.0 * torch.tanh(Z / 2.0), rtol=0, atol=1e-15)
    grads = torch.func.vmap(torch.func.grad(lambda z: z * ratio(z)))(Z)
    assert torch.all(torch.isfinite(grads))
    assert torch.allclose(grads, 1 - torch.tanh(Z / 2.0) ** 2, rtol=0, atol=1e-15)


@pytest.mark.parametrize("detach", [True, False])
def test_gemma2_capped_logit_jacobian(detach, prompt_ids):
    # final-logit soft-capping at 2 (logits reach ~1.5): frozen ratio (detached) or its derivative (ordinary)
    model = tiny_model("gemma2", seed=7)
    res = jacobian(InMemoryEngine(model, detach=detach), prompt_ids)
    logit_jacobian = logit_jacobian_of(model, res, [3, 17, 42])
    W = model.get_output_embeddings().weight[[3, 17, 42]].detach()
    z = W @ res.output
    factor = 2.0 * torch.tanh(z / 2.0) / z if detach else 1 - torch.tanh(z / 2.0) ** 2
    expected = torch.einsum("td,dnk->tnk", W, res.jacobian) * factor[:, None, None]
    assert torch.allclose(logit_jacobian, expected, rtol=0, atol=1e-13)
    if detach:
        recon = torch.einsum("tnk,nk->t", logit_jacobian, res.embeddings)
        assert torch.allclose(recon, res.logits[[3, 17, 42]], rtol=0, atol=1e-12)
