"""J itself, not only its reconstruction, against an independent hand-written computation.

Many wrong Jacobians reconstruct y (any J with J x = y does); only the right one matches
``torch.autograd.functional.jacobian`` of a detached Llama forward written here from the
architecture's definition, sharing no code with detjac.
"""

from __future__ import annotations

import torch

from detjac.engine import detached_jacobian
from detjac.engine.tiny import tiny_model


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    scale = (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt().detach()
    return x * scale * weight


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:  # (heads, n, hd)
    # Llama defines its rotary angles in float32 (whatever the model dtype); so do we.
    n, hd = x.shape[-2:]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.arange(n, dtype=torch.float32)[:, None] * inv  # (n, hd/2)
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


def manual_detached_llama(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Detached Llama forward on embeddings x (n, d) -> final normed last hidden state (d,)."""
    cfg = model.config
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd, eps, theta = cfg.hidden_size // n_heads, cfg.rms_norm_eps, cfg.rope_parameters["rope_theta"]
    n = x.shape[0]
    causal = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)
    h = x
    for layer in model.model.layers:
        att = layer.self_attn
        a = _rms(h, layer.input_layernorm.weight, eps)
        q = _rope((a @ att.q_proj.weight.T).view(n, n_heads, hd).transpose(0, 1), theta)
        k = _rope((a @ att.k_proj.weight.T).view(n, n_kv, hd).transpose(0, 1), theta)
        v = (a @ att.v_proj.weight.T).view(n, n_kv, hd).transpose(0, 1)
        group = n_heads // n_kv
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        probs = torch.softmax(q @ k.transpose(1, 2) / hd**0.5 + causal, -1).detach()
        h = h + (probs @ v).transpose(0, 1).reshape(n, -1) @ att.o_proj.weight.T
        m = _rms(h, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        gate = torch.nn.functional.silu(m @ mlp.gate_proj.weight.T).detach()
        h = h + (gate * (m @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return _rms(h, model.model.norm.weight, eps)[-1]


def test_jacobian_matches_reference_autograd(prompt_ids):
    model = tiny_model("llama", seed=3)
    model.requires_grad_(False)
    res = detached_jacobian(model, prompt_ids, row_block=7)
    ref_out = manual_detached_llama(model, res.embeddings)
    assert torch.allclose(ref_out, res.output, rtol=0, atol=1e-12)
    ref = torch.autograd.functional.jacobian(lambda x: manual_detached_llama(model, x), res.embeddings,
                                             vectorize=True)
    assert ref.shape == res.jacobian.shape
    assert (ref - res.jacobian).abs().max() < 1e-10
    # and the ordinary Jacobian differs from it by far more than that
    assert (detached_jacobian(model, prompt_ids, detach=False).jacobian - ref).abs().max() > 1e-3
