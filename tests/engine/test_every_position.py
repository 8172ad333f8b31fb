"""The every-position pullback, the per-text quantity of the Jacobian lens of Gurnee et al. (``jlens``): the
cotangent set at the final normed state of every position at once, pulled back to a layer's output, gives for each
source position k the sum ``sum_{p' >= k} dy_p' / dh_{L,k}``. Checked against an independent path: the same sum
over the prompt's prefixes of their own ``to_output`` Jacobians (each prefix's last position is one ``p'``; a causal
model computes its first positions alike whatever follows), detached and ordinary, for every causal family."""

from __future__ import annotations

import pytest
import torch
from tiny_models import N_TOKENS, STREAMABLE

from detjac.engine.checkpoints.tiny import tiny_config, tiny_model
from detjac.engine.families import family_for
from detjac.engine.streamed.streamed_engine import StreamedEngine, Target
from detjac.errors import InvalidArgumentError

CAUSAL = [t for t in STREAMABLE if not family_for(tiny_config(t)).encoder]


def _over_prefixes(sm: StreamedEngine, ids: list[int], layer: int) -> torch.Tensor:
    """``sum_{p'} dy_p' / dh_L`` (d, n, d) from the to_output Jacobians of every prefix ``ids[:p' + 1]``."""
    n, d, target = len(ids), sm.d_model, Target(layer, "to_output")
    total = torch.zeros(d, n, d, dtype=torch.float64)
    for end in range(1, n + 1):
        total[:, :end] += sm.jacobians(ids[:end], [target])[target]
    return total


@pytest.mark.parametrize("detach", [True, False], ids=["detached", "ordinary"])
@pytest.mark.parametrize("model_type", CAUSAL)
def test_every_position_pullback_equals_the_sum_over_prefixes(model_type: str, detach: bool) -> None:
    sm = StreamedEngine(tiny_model(model_type, seed=7), dtype=torch.float64, detach=detach)
    ids = torch.randint(3, 160, (N_TOKENS,), generator=torch.Generator().manual_seed(5)).tolist()
    layers = [0, sm.n_layers - 1]
    got = sm.pull_every_position(sm.trace(ids), torch.eye(sm.d_model, dtype=torch.float64), layers)
    for layer in layers:
        ref = _over_prefixes(sm, ids, layer)
        assert (got[layer] - ref).abs().max() <= 1e-12 * ref.abs().max(), (model_type, layer)
        same_position = sm.jacobians(ids, [Target(layer, "to_output")])[Target(layer, "to_output")]
        assert (got[layer][:, -1] - same_position[:, -1]).abs().max() <= 1e-12 * ref.abs().max()  # p' = n-1 only
        assert (got[layer][:, 0] - same_position[:, 0]).abs().max() > 1e-6 * ref.abs().max()  # later p' count


def test_a_sweep_from_every_position_refuses_other_targets() -> None:
    from detjac.engine.streamed import passes as sweeps

    sm = StreamedEngine(tiny_model("llama", seed=7), dtype=torch.float64)
    trace = sm.trace([5, 6, 7])
    seed = torch.zeros(2, 3, sm.d_model, dtype=torch.float64)
    with pytest.raises(InvalidArgumentError, match="Expected only output and to_output targets"):
        list(sweeps.reverse(sm.skeleton, sm.steps, trace, [Target(0, "layer")], 0, 2, seed=seed,
                            every_position=True))
    with pytest.raises(InvalidArgumentError, match="Expected a layer index in"):
        sm.pull_every_position(trace, seed[:, 0], [sm.n_layers])


def test_lens_fit_jlens_saves_the_mean_over_source_positions_of_the_sum_over_prefixes(tmp_path) -> None:
    """`detjac lens fit --estimator jlens` on the default model: the saved lens is, per layer, the mean over source
    positions 16..n-2 of the prefix sum (an independent path), and `lens evaluate` reads it."""
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
                                       "--prompts", str(prompts), "--layers", "0,-1"])
    assert result.exit_code == 0, result.output
    assert "1 texts (1 too short)" in result.output
    lens = load_lens(out)
    assert lens.info["estimator"] == "jlens" and lens.kind == "detached" and list(lens.count) == [1, 1]
    sm = load_engine(resolve_model("default"), streamed=True, dtype=torch.float64)
    ids = sm.token_ids(text)
    assert 20 < len(ids) < 128
    for i, layer in enumerate([0, sm.n_layers - 1]):
        assert list(lens.layers)[i] == layer
        ref = _over_prefixes(sm, ids, layer)[:, 16:len(ids) - 1].mean(1).numpy()
        assert abs(lens.mean[i] - ref).max() <= 1e-12 * abs(ref).max()
    again = CliRunner().invoke(main, ["lens", "fit", str(out), "--estimator", "jlens", "--model", "default",
                                      "--prompts", str(prompts)])
    assert again.exit_code == 1 and "--force replaces it" in again.output
    wrong = CliRunner().invoke(main, ["lens", "fit", str(tmp_path / "s.zarr"), "--prompts", str(prompts)])
    assert wrong.exit_code == 2 and "only with --estimator jlens" in wrong.output
    evaluated = CliRunner().invoke(main, ["lens", "evaluate", str(out), "--prompts", str(prompts), "--exact", "0"])
    assert evaluated.exit_code == 0, evaluated.output
