"""The every-position pullback: the cotangent set at the final normed state of every position at once, pulled back
to a layer's output, gives for each source position k the sum ``sum_{p' >= k} dy_p' / dh_{L,k}``; and the pullback
from the final block's output at chosen positions, the per-text quantity of the reference Jacobian lens (``jlens``).
Checked against independent paths: the same sums over the prompt's prefixes of their own ``to_output`` Jacobians
(each prefix's last position is one ``p'``; a causal model computes its first positions alike whatever follows),
detached and ordinary, for every causal family; torch.autograd on the stock model for the ordinary final block."""

from __future__ import annotations

import pytest
import torch
from tiny_models import N_TOKENS, STREAMABLE, swept

from detjac.engine import pull_final_block
from detjac.engine.checkpoints.tiny import tiny_config, tiny_model
from detjac.engine.families import family_for
from detjac.engine.streamed.streamed_engine import StreamedEngine
from detjac.engine.tools.lens_pulls import pull_every_position
from detjac.errors import InvalidArgumentError
from detjac.targets import Target

CAUSAL = [t for t in STREAMABLE if not family_for(tiny_config(t)).encoder]


def _over_prefixes(sm: StreamedEngine, ids: list[int], layers: list[int]) -> tuple[dict, dict]:
    """For each layer ``L``: ``sum_{p'} dy_p' / dh_L`` (d, n, d) from the to_output Jacobians of every prefix
    ``ids[:p' + 1]``, and the whole prompt's own to_output Jacobian (the last prefix's); one pass per prefix gives
    every layer's."""
    n, d = len(ids), sm.d_model
    targets = {layer: Target(layer, "to_output") for layer in layers}
    total = {layer: torch.zeros(d, n, d, dtype=torch.float64) for layer in layers}
    for end in range(1, n + 1):
        res = swept(sm, ids[:end], list(targets.values()))
        for layer, target in targets.items():
            total[layer][:, :end] += res[target]
    return total, {layer: res[target] for layer, target in targets.items()}


@pytest.mark.parametrize("detach", [True, False], ids=["detached", "ordinary"])
@pytest.mark.parametrize("model_type", CAUSAL)
def test_every_position_pullback_equals_the_sum_over_prefixes(model_type: str, detach: bool) -> None:
    sm = StreamedEngine(tiny_model(model_type, seed=7), dtype=torch.float64, detach=detach)
    ids = torch.randint(3, 160, (N_TOKENS,), generator=torch.Generator().manual_seed(5)).tolist()
    layers = [0, sm.n_layers - 1]
    got = pull_every_position(sm, sm.trace(ids), torch.eye(sm.d_model, dtype=torch.float64), layers)
    refs, whole = _over_prefixes(sm, ids, layers)
    for layer in layers:
        ref, same_position = refs[layer], whole[layer]
        assert (got[layer] - ref).abs().max() <= 1e-12 * ref.abs().max(), (model_type, layer)
        assert (got[layer][:, -1] - same_position[:, -1]).abs().max() <= 1e-12 * ref.abs().max()  # p' = n-1 only
        assert (got[layer][:, 0] - same_position[:, 0]).abs().max() > 1e-6 * ref.abs().max()  # later p' count


def test_a_sweep_from_every_position_refuses_other_targets() -> None:
    from detjac.engine import sweeps

    sm = StreamedEngine(tiny_model("llama", seed=7), dtype=torch.float64)
    trace = sm.trace([5, 6, 7])
    seed = torch.zeros(2, 3, sm.d_model, dtype=torch.float64)
    with pytest.raises(InvalidArgumentError, match="Expected only output and to_output targets"), \
            sm.walk(trace) as walk:
        list(sweeps.reverse(sm, walk, trace, [Target(0, "layer")], 0, 2, seed=seed, every_position=True))
    with pytest.raises(InvalidArgumentError, match="Expected a layer index in"):
        pull_every_position(sm, trace, seed[:, 0], [sm.n_layers])


def _final_block_over_prefixes(sm: StreamedEngine, ids: list[int], layers: list[int], valid: range) -> dict:
    """For each layer ``L``: ``mean_{k in valid} sum_{p' in valid, p' >= k} dh_final,p' / dh_{L,k}`` (d, d) by an
    independent path: each prefix ``ids[:p' + 1]``'s own ``to_output`` Jacobian at its last position, taken back
    through the final norm (``dy = diag(g s) dh_final`` for the RMSNorm with its scale ``s`` frozen:
    ``g s = norm(h) / h`` elementwise); one pass per prefix gives every layer's."""
    n, d = len(ids), sm.d_model
    targets = {layer: Target(layer, "to_output") for layer in layers}
    total = {layer: torch.zeros(d, n, d, dtype=torch.float64) for layer in layers}
    for end in valid:
        res = swept(sm, ids[:end + 1], list(targets.values()))
        h = res.trace.inputs[sm.n_layers][-1]
        scale = res.trace.norm(h) / h  # (d,) g s
        for layer, target in targets.items():
            total[layer][:, :end + 1] += res[target] / scale[:, None, None]
    return {layer: t[:, valid.start:valid.stop].mean(1) for layer, t in total.items()}


def test_pull_final_block_is_the_ordinary_autograd_jacobian_of_the_last_layer_output() -> None:
    """The ordinary engine's pullback from the final block's output at chosen positions equals torch.autograd on
    the stock model (hooks on the layers' outputs): the reference lens's per-text quantity."""
    model = tiny_model("llama", seed=7).to(torch.float64)
    sm = StreamedEngine(model, dtype=torch.float64, detach=False)
    ids = torch.randint(3, 160, (N_TOKENS,), generator=torch.Generator().manual_seed(5)).tolist()
    valid = range(2, N_TOKENS - 1)
    got = pull_final_block(sm, sm.trace(ids), torch.eye(sm.d_model, dtype=torch.float64), [0], valid)[0]
    outs = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda mod, args, out, i=i: outs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in (0, sm.n_layers - 1)]
    try:
        model.requires_grad_(False)
        emb = model.get_input_embeddings()(torch.tensor([ids])).requires_grad_(True)

        def final_from_layer0(h0: torch.Tensor) -> torch.Tensor:
            outs.clear()
            replace = model.model.layers[0].register_forward_hook(lambda mod, args, out: (h0,) if isinstance(
                out, tuple) else h0)
            try:
                model(inputs_embeds=emb)
            finally:
                replace.remove()
            return outs[sm.n_layers - 1][0]  # (n, d)

        model(inputs_embeds=emb)
        h0 = outs[0].detach().clone()
        J = torch.autograd.functional.jacobian(final_from_layer0, h0)  # (n, d, 1, n, d)
    finally:
        for h in hooks:
            h.remove()
    mask = torch.zeros(N_TOKENS, dtype=torch.float64)
    mask[list(valid)] = 1.0
    want = torch.einsum("p,prqc->rqc", mask, J[:, :, 0])  # (d, n, d): the sum over the valid targets
    # the stock norms compute in float32 (~1e-7): a wrong target or target positions would differ by O(1)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    assert got[:, -1].abs().max() == 0 and want[:, 2].abs().max() > 0.1 * want.abs().max()  # n-1 is no target


def test_lens_fit_jlens_follows_the_reference_conventions(tmp_path) -> None:
    """`detjac lens fit --estimator jlens` on the default model: the saved lens is, per layer, the reference's
    estimator (target the final block's output before the final norm, valid positions 16 .. n-2 as targets and
    as sources), checked against an independent path; the last layer is not fitted by default; `lens evaluate`
    reads it through the final norm."""
    from click.testing import CliRunner

    from detjac.analysis.lens import load_lens
    from detjac.cli.main import main
    from detjac.engine import load_engine
    from detjac.engine.checkpoints.default import resolve_model

    text = "Harbor, n. A port or place of refuge for ships, sheltered from storms, where they may lie at anchor"
    prompts = tmp_path / "texts.txt"
    prompts.write_text(text + "\n\nHi\n")  # the second text is too short: not counted
    out = tmp_path / "texts.jlens"
    result = CliRunner().invoke(main, ["lens", "fit", str(out), "--estimator", "jlens", "--model", "default",
                                       "--prompts", str(prompts), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "1 texts (1 too short)" in result.output
    lens = load_lens(out)
    sm = load_engine(resolve_model("default"), streamed=True, dtype=torch.float64)
    assert lens.info["estimator"] == "jlens" and lens.kind == "detached" and lens.before_norm
    assert list(lens.layers) == list(range(sm.n_layers - 1)) and list(lens.count) == [1] * (sm.n_layers - 1)
    ids = sm.token_ids(text)
    assert 20 < len(ids) < 128
    refs = _final_block_over_prefixes(sm, ids, [0, sm.n_layers - 2], range(16, len(ids) - 1))
    for layer, ref in refs.items():
        ref = ref.numpy()
        assert abs(lens.operator(layer) - ref).max() <= 1e-10 * abs(ref).max()
    again = CliRunner().invoke(main, ["lens", "fit", str(out), "--estimator", "jlens", "--model", "default",
                                      "--prompts", str(prompts)])
    assert again.exit_code == 1 and "--force replaces it" in again.output
    wrong = CliRunner().invoke(main, ["lens", "fit", str(tmp_path / "s.zarr"), "--prompts", str(prompts)])
    assert wrong.exit_code == 2 and "only with --estimator jlens" in wrong.output
    wrong = CliRunner().invoke(main, ["lens", "fit", str(tmp_path / "s.zarr"), "--device", "cpu"])
    assert wrong.exit_code == 2 and "--device only with --estimator jlens" in wrong.output
    evaluated = CliRunner().invoke(main, ["lens", "evaluate", str(out), "--prompts", str(prompts), "--exact", "0",
                                          "--device", "cpu"])
    assert evaluated.exit_code == 0, evaluated.output
    if not torch.cuda.is_available():  # a device this PyTorch lacks: one line, nothing written
        for args in (["fit", str(tmp_path / "gpu.jlens"), "--estimator", "jlens", "--model", "default", "--prompts",
                      str(prompts)], ["evaluate", str(out), "--prompts", str(prompts)]):
            refused = CliRunner().invoke(main, ["lens", *args, "--device", "cuda:0"])
            assert refused.exit_code == 1 and "Traceback" not in refused.output, refused.output
            assert refused.output.startswith("Error: Expected a device this PyTorch can compute on")
        assert not (tmp_path / "gpu.jlens").exists()
