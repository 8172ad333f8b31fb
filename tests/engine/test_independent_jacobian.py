"""J itself, not only its reconstruction, against an independent hand-written computation.

Many wrong Jacobians reconstruct y (any J with J x = y does); only the right one matches
``torch.autograd.functional.jacobian`` of a detached Llama (and, for an affine model, GPT-2)
forward written here from the architecture's definition, sharing no code with detjac.
"""

from __future__ import annotations

import torch

from detjac.engine import InMemoryEngine, jacobian
from detjac.engine.checkpoints.tiny import tiny_model


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
    res = jacobian(InMemoryEngine(model), prompt_ids, row_block=7)
    ref_out = manual_detached_llama(model, res.embeddings)
    assert torch.allclose(ref_out, res.output, rtol=0, atol=1e-12)
    ref = torch.autograd.functional.jacobian(lambda x: manual_detached_llama(model, x), res.embeddings,
                                             vectorize=True)
    assert ref.shape == res.jacobian.shape
    assert (ref - res.jacobian).abs().max() < 1e-10
    # and the ordinary Jacobian differs from it by far more than that
    assert (jacobian(InMemoryEngine(model, detach=False), prompt_ids).jacobian - ref).abs().max() > 1e-3


def manual_detached_gpt2(model: torch.nn.Module, x: torch.Tensor, factors: list[torch.Tensor],
                         replay: bool = False) -> torch.Tensor:
    """Detached GPT-2 forward on token embeddings x (n, d) -> final normed last hidden state (d,).

    Frozen factors are appended to ``factors``, or, with ``replay``, taken from it in order.
    """
    it = iter(list(factors)) if replay else None

    def frozen(value: torch.Tensor) -> torch.Tensor:
        if it is not None:
            return next(it)
        factors.append(value.detach())
        return factors[-1]

    def ln(h: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        c = h - h.mean(-1, keepdim=True)
        return c * frozen((c.pow(2).mean(-1, keepdim=True) + norm.eps).rsqrt()) * norm.weight + norm.bias

    cfg, n = model.config, x.shape[0]
    heads, hd = cfg.n_head, cfg.n_embd // cfg.n_head
    causal = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)
    tr = model.transformer
    h = x + tr.wpe.weight[:n]
    for block in tr.h:
        a = ln(h, block.ln_1)
        q, k, v = (a @ block.attn.c_attn.weight + block.attn.c_attn.bias).split(cfg.n_embd, -1)
        q, k, v = (t.view(n, heads, hd).transpose(0, 1) for t in (q, k, v))
        probs = frozen(torch.softmax(q @ k.transpose(1, 2) / hd**0.5 + causal, -1))
        h = h + (probs @ v).transpose(0, 1).reshape(n, -1) @ block.attn.c_proj.weight + block.attn.c_proj.bias
        f = ln(h, block.ln_2) @ block.mlp.c_fc.weight + block.mlp.c_fc.bias
        gelu_new = 0.5 * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (f + 0.044715 * f**3)))
        h = h + (f * frozen(gelu_new)) @ block.mlp.c_proj.weight + block.mlp.c_proj.bias
    return ln(h, tr.ln_f)[-1]


def test_affine_jacobian_and_offset_match_reference_autograd(prompt_ids):
    # GPT-2: J from autograd of a hand-written detached forward, b from replaying its factors on zeros.
    model = tiny_model("gpt2", seed=3)
    model.requires_grad_(False)
    res = jacobian(InMemoryEngine(model), prompt_ids, row_block=7)
    factors: list[torch.Tensor] = []
    assert torch.allclose(manual_detached_gpt2(model, res.embeddings, factors), res.output, rtol=0, atol=1e-12)
    ref = torch.autograd.functional.jacobian(
        lambda x: manual_detached_gpt2(model, x, factors, replay=True), res.embeddings, vectorize=True)
    assert (ref - res.jacobian).abs().max() < 1e-10
    bias = manual_detached_gpt2(model, torch.zeros_like(res.embeddings), factors, replay=True)
    assert torch.allclose(bias, res.bias, rtol=0, atol=1e-12)
