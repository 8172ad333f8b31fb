"""Exactness of the detached Jacobian for every family (float64, tiny random models)."""

from __future__ import annotations

import pytest
import torch

from detjac.engine import InMemoryEngine, jacobian
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.engine.detach.model import linearized
from detjac.engine.products.logits import logit_jacobian
from detjac.engine.result import reconstruct
from detjac.targets import OUTPUTS

# The stock models cast norms and softmax to float32, so a float64 stock model agrees
# with the exact one only to about 1e-7 (measured <= 5e-7 on these configs).
STOCK_LOGIT_ATOL = 1e-5


def test_detached_reconstruction_is_exact(family_model, prompt_ids):
    res = jacobian(InMemoryEngine(family_model), prompt_ids, row_block=16)
    n, d = len(prompt_ids), family_model.config.get_text_config().hidden_size
    assert res.jacobian.shape == (d, n, d)
    assert res.embeddings.shape == (n, d) and res.output.shape == (d,)
    assert res.reconstruction_error < 1e-12
    manual = torch.einsum("rnd,nd->r", res.jacobian, res.embeddings)
    if res.bias is not None:  # an affine model: y = sum_k J_k x_k + b
        manual = manual + res.bias
    assert torch.allclose(manual, res.output, rtol=0, atol=1e-12 * res.output.norm())


def test_matches_unmodified_model(family_model, prompt_ids):
    res = jacobian(InMemoryEngine(family_model), prompt_ids)
    stock = InMemoryEngine(family_model).stock_logits(prompt_ids, res.position)
    assert torch.allclose(res.logits, stock, rtol=0, atol=STOCK_LOGIT_ATOL)
    assert torch.allclose(res.reconstruction_logits, stock, rtol=0, atol=STOCK_LOGIT_ATOL)
    assert res.next_token_id == res.reconstructed_next_token_id == int(stock.argmax())


def test_ordinary_jacobian_does_not_reconstruct(family_model, prompt_ids):
    ordinary = jacobian(InMemoryEngine(family_model, detach=False), prompt_ids)
    detached = jacobian(InMemoryEngine(family_model), prompt_ids)
    assert ordinary.reconstruction_error > 1e-3
    assert torch.equal(ordinary.output, detached.output)  # same forward, different Jacobian
    assert not torch.allclose(ordinary.jacobian, detached.jacobian)


def test_result_independent_of_row_block(family_model, prompt_ids):
    ref = jacobian(InMemoryEngine(family_model), prompt_ids, row_block=32)  # every row in one block: the MLPs fold
    scale = ref.jacobian.abs().max()
    for rb in (1, 5, 64):  # to float64 rounding: a folded MLP sums in another order
        other = jacobian(InMemoryEngine(family_model), prompt_ids, row_block=rb)
        assert (other.jacobian - ref.jacobian).abs().max() <= 1e-13 * scale


def test_stream_yields_blocks_in_order(prompt_ids):
    model = tiny_model("llama")
    engine = InMemoryEngine(model)
    trace = engine.trace(prompt_ids)
    plan = engine.plan(trace, [OUTPUTS], row_block=10)
    blocks = list(engine.blocks(trace, [OUTPUTS], plan))
    assert [(b.start, b.stop) for b in blocks] == [(0, 10), (10, 20), (20, 30), (30, 32)]
    assert plan.n_blocks == 4 and all(b.values.shape[1:] == trace.embeddings.shape for b in blocks)
    # blocks carry no autograd graph: one would keep every intermediate cotangent alive
    assert all(b.values.grad_fn is None and not b.values.requires_grad for b in blocks)
    jac = torch.cat([b.values for b in blocks])
    assert torch.allclose(reconstruct(jac, trace.embeddings), trace.output, rtol=0, atol=1e-12)


def test_model_is_restored_after_linearizing(family_model, prompt_ids):
    before = {k: v.clone() for k, v in family_model.state_dict().items()}
    classes = [type(m) for m in family_model.modules()]
    impl = family_model.config._attn_implementation
    logits = InMemoryEngine(family_model).stock_logits(prompt_ids, -1)
    jacobian(InMemoryEngine(family_model), prompt_ids)
    assert [type(m) for m in family_model.modules()] == classes
    assert family_model.config._attn_implementation == impl
    assert all(torch.equal(before[k], v) for k, v in family_model.state_dict().items())
    assert all(p.requires_grad for p in family_model.parameters())
    assert torch.equal(InMemoryEngine(family_model).stock_logits(prompt_ids, -1), logits)


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text", "qwen3"])
def test_sliding_window_zeroes_distant_tokens(model_type, prompt_ids):
    # One sliding layer: the last output sees only the last WINDOW tokens, so every
    # earlier token's operator is exactly zero. A lost mask would make them nonzero.
    over = {"num_hidden_layers": 1}
    if model_type == "gemma3_text":
        over["layer_types"] = ["sliding_attention"]
    if model_type == "qwen3":
        over["max_window_layers"] = 0
    model = tiny_model(model_type, **over)
    res = jacobian(InMemoryEngine(model), prompt_ids)
    window = model.config.sliding_window
    norms = res.jacobian.abs().amax(dim=(0, 2))  # (n_tokens,)
    assert torch.all(norms[: -window] == 0)
    assert torch.all(norms[-window:] > 0)
    assert res.reconstruction_error < 1e-12


def test_causality_at_an_inner_position(prompt_ids):
    model = tiny_model("llama")
    res = jacobian(InMemoryEngine(model), prompt_ids, position=5)
    assert torch.all(res.jacobian[:, 6:] == 0) and torch.all(res.jacobian[:, 5].abs().amax() > 0)
    assert res.reconstruction_error < 1e-12


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-4), (torch.bfloat16, 1e-1)])
def test_lower_precision_runs(dtype, bound, prompt_ids):
    res = jacobian(InMemoryEngine(tiny_model("llama", dtype=dtype)), prompt_ids)
    assert res.jacobian.dtype == dtype
    assert res.reconstruction_error < bound


def test_logit_jacobian_is_unembedding_times_j(prompt_ids):
    model = tiny_model("llama")
    tokens = [3, 17, 42]
    res = jacobian(InMemoryEngine(model), prompt_ids)
    lj = logit_jacobian(model, res, tokens)
    W = model.get_output_embeddings().weight[tokens]
    assert torch.allclose(lj, torch.einsum("td,dnk->tnk", W, res.jacobian), atol=1e-13)
    assert torch.allclose(reconstruct(lj, res.embeddings), res.logits[tokens], atol=1e-12)


def test_logit_jacobian_with_final_softcapping(prompt_ids):
    model = tiny_model("gemma3_text", final_logit_softcapping=0.5)
    res = jacobian(InMemoryEngine(model), prompt_ids)
    lj = logit_jacobian(model, res)
    assert lj.shape[0] == model.config.vocab_size
    with torch.no_grad():
        stock = model(torch.tensor([prompt_ids])).logits[0, -1]
    recon = reconstruct(lj, res.embeddings)
    assert torch.allclose(recon, res.logits, rtol=0, atol=1e-12)
    assert torch.allclose(recon, stock, rtol=0, atol=1e-5)


def test_linearized_forward_equals_detached_output(family_model, prompt_ids):
    res = jacobian(InMemoryEngine(family_model), prompt_ids)
    with linearized(family_model) as lin, torch.no_grad():
        hidden = lin.decoder(input_ids=torch.tensor([prompt_ids])).last_hidden_state[0, res.position]
    assert torch.equal(hidden, res.output)
