"""The matrix-free Jacobian operator and its top singular triplets, against the formed J and its full SVD."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from detjac.engine import InMemoryEngine, jacobian, load_model
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.engine.products.lanczos import operator_svd
from detjac.engine.products.linear_operator import (
    JacobianOperator,
    ModelOperator,
    OperatorStats,
    check_block,
    jacobian_operator,
)
from detjac.engine.streamed.streamed_engine import StreamedEngine
from detjac.errors import InvalidArgumentError

EXACT = 1e-12
SIGMA_REL = 1e-8


pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _min_cosine(A: torch.Tensor, B: torch.Tensor) -> float:
    """Cosine of the largest principal angle between span(A) and span(B) (orthonormal columns)."""
    return float(torch.linalg.svdvals(A.T @ B).min())


class MatrixOperator(JacobianOperator):
    """An explicit matrix behind the operator interface: the algorithm alone, on a spectrum chosen by the test."""

    def __init__(self, J: torch.Tensor, n_tokens: int, block: int = 16) -> None:
        self.block, self.stats, self.J = check_block(block), OperatorStats(), J  # no engine: _push and _pull below
        self.embeddings = torch.zeros(n_tokens, J.shape[0], dtype=J.dtype)
        self.output, self.bias, self.detached = torch.zeros(J.shape[0], dtype=J.dtype), None, True
        self.token_ids, self.position = list(range(n_tokens)), n_tokens - 1

    def _push(self, tangents: torch.Tensor) -> torch.Tensor:
        return (self.J @ tangents.reshape(tangents.shape[0], -1).T).T

    def _pull(self, cotangents: torch.Tensor) -> torch.Tensor:
        return (cotangents @ self.J).reshape(cotangents.shape[0], self.n_tokens, self.d_model)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen2", "gpt2", "bert", "qwen3_moe"])
def test_products_equal_the_formed_jacobian(model_type, prompt_ids):
    model = tiny_model(model_type, seed=7)
    res = jacobian(InMemoryEngine(model), prompt_ids)
    J = res.combined()  # (d, n d)
    V, U = _randn(J.shape[1], 5, seed=1), _randn(J.shape[0], 5, seed=2)
    for forward in ("transpose", "jvp"):
        op = ModelOperator(model, prompt_ids, block=2, forward=forward)  # blocks that do not divide 5
        assert op.shape == tuple(J.shape) and op.position == res.position % len(prompt_ids)
        assert _rel(op.matvec(V), J @ V) <= EXACT, forward
        assert _rel(op.rmatvec(U), J.T @ U) <= EXACT, forward
        assert _rel(op.matvec(V[:, 0]), J @ V[:, 0]) <= EXACT and op.matvec(V[:, 0]).shape == (J.shape[0],)
        assert op.stats.matvecs == 7 and op.stats.rmatvecs == 5 and op.stats.widest_block == 2
        # the linear part only: an affine family's offset b stays out of the products, and J x + b = y
        assert (op.bias is not None) == (res.bias is not None)
        assert op.check() < EXACT
        assert _rel(op.produced, J @ res.embeddings.reshape(-1)) < EXACT


def test_products_are_adjoint_without_forming_j(prompt_ids):
    model = tiny_model("gpt2", seed=3)
    op = jacobian_operator(model, prompt_ids, block=4)
    v, u = _randn(op.shape[1], seed=3), _randn(op.shape[0], seed=4)
    left, right = torch.dot(op.matvec(v), u), torch.dot(v, op.rmatvec(u))
    assert abs(float(left - right)) <= EXACT * abs(float(left))


def test_streamed_operator_equals_formed_jacobian_and_streams_layers(llama_checkpoint: Path, prompt_ids):
    J = jacobian(InMemoryEngine(load_model(llama_checkpoint)), prompt_ids).combined()
    sm = StreamedEngine(llama_checkpoint)
    op = jacobian_operator(sm, prompt_ids, block=3)
    assert isinstance(op, JacobianOperator) and op.engine is sm and op.shape == tuple(J.shape)
    V, U = _randn(J.shape[1], 4, seed=5), _randn(J.shape[0], 4, seed=6)
    assert _rel(op.matvec(V), J @ V) <= EXACT and _rel(op.rmatvec(U), J.T @ U) <= EXACT
    assert abs(float(torch.dot(op.matvec(V[:, 0]), U[:, 0]) - torch.dot(V[:, 0], op.rmatvec(U[:, 0])))) \
        <= EXACT * float((J @ V[:, 0]).norm() * U[:, 0].norm())
    assert op.check() < EXACT
    loaded = sm.stats.layers_loaded
    op.gram(U[:, :3])  # one block: one sweep down and one up
    assert sm.stats.layers_loaded - loaded == 2 * sm.n_layers
    assert sm.stats.max_resident_layers == 1 and not sm.stats.resident


@pytest.mark.parametrize("method", ["lanczos", "randomized"])
def test_operator_svd_matches_the_full_svd(method, prompt_ids):
    model = tiny_model("llama", seed=7)
    J = jacobian(InMemoryEngine(model), prompt_ids).combined()
    U_ref, S_ref, Vh_ref = torch.linalg.svd(J, full_matrices=False)
    k = 6
    op = jacobian_operator(model, prompt_ids, block=8)
    res = operator_svd(op, k, method=method, block=4, oversample=6, orient=op.produced)
    assert res.converged and float(res.residuals.max()) <= res.tol
    assert float(((res.S - S_ref[:k]).abs() / S_ref[:k]).max()) <= SIGMA_REL
    assert _min_cosine(res.U, U_ref[:, :k]) >= 1 - SIGMA_REL  # the same subspaces, signs aside
    assert _min_cosine(res.V, Vh_ref[:k].T) >= 1 - SIGMA_REL
    assert torch.allclose(J @ res.V, res.U * res.S, rtol=0, atol=1e-8 * float(S_ref[0]))
    assert bool((op.produced @ res.U >= 0).all())
    U, S, V = res  # unpacks like an SVD
    assert U.shape == (J.shape[0], k) and S.shape == (k,) and V.shape == (J.shape[1], k)
    assert res.matvecs == res.rmatvecs == op.stats.matvecs == op.stats.rmatvecs
    if method == "lanczos":  # the basis, then J^T U for V and J V to verify; at most twice what forming J costs
        assert res.matvecs == res.basis + k and res.basis <= J.shape[0]


def test_streamed_and_in_memory_operators_give_the_same_triplets(llama_checkpoint: Path, prompt_ids):
    ops = [jacobian_operator(load_model(llama_checkpoint), prompt_ids), jacobian_operator(
        StreamedEngine(llama_checkpoint), prompt_ids)]
    a, b = (operator_svd(op, 4, block=4, orient=op.produced) for op in ops)
    assert float(((a.S - b.S).abs() / a.S).max()) <= SIGMA_REL
    assert _min_cosine(a.U, b.U) >= 1 - SIGMA_REL


def test_clustered_and_repeated_singular_values():
    # sigma_1 = sigma_2 exactly, then a cluster 1e-6 apart, above a flat bulk: a block wider than the
    # multiplicity finds both copies, and the residual test resolves the cluster to 1e-8.
    d, n = 48, 5
    gen = torch.Generator().manual_seed(0)
    top = torch.tensor([10.0, 10.0, 9.0, 9.0 - 9e-6, 9.0 - 1.8e-5, 8.0], dtype=torch.float64)
    S = torch.cat([top, torch.linspace(7.5, 0.5, d - len(top), dtype=torch.float64)])
    Ul = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0]
    Vr = torch.linalg.qr(torch.randn(n * d, d, generator=gen, dtype=torch.float64))[0]
    op = MatrixOperator(Ul @ torch.diag(S) @ Vr.T, n)
    res = operator_svd(op, 6, block=4)
    assert res.converged
    assert float(((res.S - S[:6]).abs() / S[:6]).max()) <= SIGMA_REL
    assert _min_cosine(res.U[:, :2], Ul[:, :2]) >= 1 - SIGMA_REL  # the whole eigenspace of the double value
    assert _min_cosine(res.U[:, 2:5], Ul[:, 2:5]) >= 1 - 1e-6  # the cluster as a subspace


def test_lanczos_ends_exactly_when_its_basis_fills_the_space():
    # A tolerance below rounding is never met: the basis grows to all of R^d and Rayleigh-Ritz is then exact.
    d, n = 24, 3
    J = _randn(d, n * d, seed=9)
    op = MatrixOperator(J, n, block=5)
    res = operator_svd(op, 3, block=7, tol=1e-18)  # 7 does not divide 24: the last block is narrower
    assert res.basis == d and res.iterations == 4 and not res.converged
    S_ref = torch.linalg.svdvals(J)[:3]
    assert float(((res.S - S_ref).abs() / S_ref).max()) <= 1e-12


def test_long_prompt_never_forms_j(monkeypatch):
    # 400 tokens with d_model 64: J would be 64 x 25,600. The operator must not take the row-forming
    # path, and no single allocation may come near J's size (the largest are of the attention
    # probabilities' size, a block of 2 x 400 x 400).
    def refuse(*_a, **_k):
        raise AssertionError("the row-forming path was called")

    monkeypatch.setattr(InMemoryEngine, "blocks", refuse)
    monkeypatch.setattr(StreamedEngine, "blocks", refuse)
    model = tiny_model("llama", seed=1, hidden_size=64, intermediate_size=96, num_attention_heads=1,
                       num_key_value_heads=1, max_position_embeddings=512)
    ids = torch.randint(3, 160, (400,), generator=torch.Generator().manual_seed(2)).tolist()
    op = jacobian_operator(model, ids, block=2)
    j_bytes = op.shape[0] * op.shape[1] * op.dtype.itemsize
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        res = operator_svd(op, 4, block=4)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest < j_bytes / 4, (largest, j_bytes)
    assert res.converged and op.stats.widest_block == 2
    again = operator_svd(op, 4, block=6, seed=1)  # another start, another Krylov space: the same values
    assert float(((res.S - again.S).abs() / res.S).max()) <= SIGMA_REL


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"k": 0}, "Expected k between 1 and the rank bound min(d_model, n_tokens * d_model) = 32 of a 32 x 64"),
    ({"k": -3}, "Expected k between 1 and the rank bound"),
    ({"k": 33}, "Got 33."),
    ({"k": 2.5}, "Got 2.5."),
    ({"k": 2, "method": "power"}, "Expected method one of lanczos, randomized. Got 'power'."),
    ({"k": 2, "block": 0}, "Expected block to be an integer >= 1. Got 0."),
    ({"k": 2, "tol": 0.0}, "Expected tol in (0, 1)"),
    ({"k": 2, "max_iters": 0}, "Expected max_iters to be an integer >= 1. Got 0."),
])
def test_bad_arguments_are_refused(kwargs, message):
    op = MatrixOperator(_randn(32, 64), 2)
    with pytest.raises(InvalidArgumentError) as err:
        operator_svd(op, **kwargs)
    assert message in str(err.value)
    assert op.stats.products == 0  # refused before any product


def test_operator_checks_its_inputs(prompt_ids):
    op = MatrixOperator(_randn(32, 64), 2)
    with pytest.raises(InvalidArgumentError, match=r"Expected matvec of a tensor \(64,\) or \(64, columns\). "
                                                    r"Got \(32, 2\)."):
        op.matvec(_randn(32, 2))
    with pytest.raises(InvalidArgumentError, match="Expected rmatvec of a tensor"):
        op.rmatvec(_randn(32, 2, 2))
    with pytest.raises(InvalidArgumentError, match="Expected block to be a positive integer. Got 0 instead."):
        MatrixOperator(_randn(32, 64), 2, block=0)
    with pytest.raises(InvalidArgumentError, match="Expected forward one of transpose, jvp. Got 'reverse'."):
        ModelOperator(tiny_model("llama"), prompt_ids, forward="reverse")


def test_an_iteration_limit_is_reported_not_hidden():
    op = MatrixOperator(_randn(32, 96, seed=4), 3)
    res = operator_svd(op, 4, method="randomized", oversample=0, max_iters=1)
    assert not res.converged and res.iterations == 1 and float(res.residuals.max()) > res.tol
