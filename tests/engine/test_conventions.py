"""Detach conventions: Phi3's `gate` convention (the paper's reference code) is exact, independent, recorded;
a convention a family lacks is refused with the valid ones."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from store_helpers import write_prompts
from tiny_models import swept

from detjac.cli.main import main
from detjac.engine import InMemoryEngine, StreamedEngine, jacobian
from detjac.engine.checkpoints.tiny import save_tiny_checkpoint, tiny_model
from detjac.engine.detach.wrappers import DetachedGatedMLP
from detjac.engine.families import family_for
from detjac.errors import InvalidArgumentError
from detjac.store import open_store, verify_prompt

EXACT = 1e-12


def test_gate_convention_mlp_equals_the_formula_written_out() -> None:
    model = tiny_model("phi3", seed=5).double()
    mlp = model.model.layers[0].mlp
    rule = family_for(model.config).mlp_rule(mlp)
    x = torch.randn(3, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    gate_w, up_w = mlp.gate_up_proj.weight.chunk(2, dim=0)  # (i, d) each
    g, u = x @ gate_w.T, x @ up_w.T  # (3, i)
    wrapped = DetachedGatedMLP(mlp, rule, detach=True, convention="gate")
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), mlp(x), rtol=0, atol=1e-13)  # the forward is the stock one
    J = torch.autograd.functional.jacobian(lambda v: wrapped(v[None])[0], x[1])  # (d, d)
    # down . diag(sigmoid(g) * up) . W_gate: the linear path through gate, sigmoid(g) and up(x) frozen
    expected = mlp.down_proj.weight @ ((torch.sigmoid(g[1]) * u[1])[:, None] * gate_w)
    torch.testing.assert_close(J, expected, rtol=0, atol=1e-12)
    default = torch.autograd.functional.jacobian(lambda v: DetachedGatedMLP(mlp, rule, True)(v[None])[0], x[1])
    torch.testing.assert_close(default, mlp.down_proj.weight @ ((torch.nn.functional.silu(g[1]))[:, None] * up_w),
                               rtol=0, atol=1e-12)
    assert (J - default).abs().max() > 1e-3  # both exact, and different


def test_gate_convention_is_exact_in_both_engines(prompt_ids: list[int]) -> None:
    model = tiny_model("phi3", seed=7)
    mem = InMemoryEngine(model.double(), convention="gate")
    res = jacobian(mem, prompt_ids)
    J = res.jacobian
    assert mem.convention == "gate"
    err = (torch.einsum("rtc,tc->r", J, res.embeddings) - res.output).norm() / res.output.norm()
    assert err < EXACT
    J_up = jacobian(InMemoryEngine(model), prompt_ids).jacobian
    assert (J - J_up).abs().max() > 1e-3
    sm = StreamedEngine(model, dtype=torch.float64, convention="gate")
    res = swept(sm, prompt_ids, ["output", "layer.0", "mlp.1", "mlp_normed.1", "to_output.0"], row_block=16)
    assert (res["output"] - J).abs().max() < EXACT
    for t in res.jacobians:
        assert res.reconstruction_error(t) < EXACT, t.name


def test_a_convention_the_family_lacks_is_refused(tmp_path) -> None:
    with pytest.raises(InvalidArgumentError, match="among up. Got 'gate'"):
        InMemoryEngine(tiny_model("llama"), convention="gate")
    with pytest.raises(InvalidArgumentError, match="among up, gate. Got 'reference'"):
        StreamedEngine(tiny_model("phi3"), convention="reference")
    prompts = write_prompts(tmp_path / "p.txt", ["The fog rolls over the bay and"])
    bad = CliRunner().invoke(main, ["run", "default", str(prompts), "--out", str(tmp_path / "s.zarr"),
                                    "--convention", "gate"])
    assert bad.exit_code != 0 and "among up. Got 'gate'" in bad.output and "Traceback" not in bad.output
    assert not (tmp_path / "s.zarr").exists()


def test_the_convention_is_recorded_and_keeps_stores_apart(tmp_path) -> None:
    ckpt = save_tiny_checkpoint(tmp_path / "phi3", "phi3")
    prompts = write_prompts(tmp_path / "p.txt", ["The fog rolls over the bay and"])
    for name, extra in (("gate", ["--convention", "gate"]), ("up", [])):
        result = CliRunner().invoke(main, ["run", str(ckpt), str(prompts), "--out", str(tmp_path / f"{name}.zarr"),
                                           "--layers", "0", "--components", "layer_normed", *extra])
        assert result.exit_code == 0, result.output
    gate, up = open_store(tmp_path / "gate.zarr"), open_store(tmp_path / "up.zarr")
    assert gate.run["convention"] == "gate" and "convention gate" in " ".join(gate.run["detach_rules"])
    assert up.run["convention"] is None  # the family's default, which leaves prompt ids as they were
    (pg,), (pu,) = list(gate), list(up)
    assert pg.id != pu.id and "convention gate" in " ".join(pg.attrs["detach_rules"])
    assert verify_prompt(tmp_path / "gate.zarr" / "prompts" / pg.id).ok
    resumed = CliRunner().invoke(main, ["run", str(ckpt), str(prompts), "--out", str(tmp_path / "gate.zarr"),
                                        "--layers", "0", "--components", "layer_normed"])
    assert resumed.exit_code != 0 and "convention: 'gate' (store) != None" in resumed.output, resumed.output
