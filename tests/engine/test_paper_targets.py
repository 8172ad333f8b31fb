"""The paper's layerwise targets (normed, resid_mid, to_output): exact, and equal to independent autograd."""

from __future__ import annotations

import pytest
import torch
from tiny_models import swept

from detjac.engine import assemble
from detjac.engine.detach.model import linearized
from detjac.engine.families import family_for
from detjac.engine.products.decode import final_norm_gain
from detjac.engine.streamed.streamed_engine import StreamedEngine
from detjac.errors import InvalidArgumentError
from detjac.targets import Target, kinds, layer_targets

EXACT = 1e-12
NEW = "resid_mid,layer_normed,attn_normed,mlp_normed,to_output"
NEW_LOCAL = "resid_mid_local,layer_normed_local,attn_normed_local,mlp_normed_local"


def _layer_output(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[index]


def _frozen_norm(model: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The final RMSNorm written out: ``gain * h / rms(h)`` with ``rms`` detached (frozen at h's own value)."""
    decoder = family_for(model.config).decoder(model)
    norm = getattr(decoder.norm, "inner", decoder.norm)  # the stock module (inside a linearized wrapper)
    rule = family_for(model.config).norm_rule(norm)
    eps = float(getattr(norm, rule.eps_attr))
    rms = torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps).detach()
    return final_norm_gain(model).to(h.dtype) * h / rms


def test_new_targets_reconstruct_in_both_modes_for_every_family(streamable_model: torch.nn.Module,
                                                               prompt_ids: list[int]) -> None:
    sm = StreamedEngine(streamable_model, dtype=torch.float64)
    targets = ["output", *(t.name for t in layer_targets("all", f"{NEW},{NEW_LOCAL}", sm.n_layers))]
    rev = swept(sm, prompt_ids, targets, mode="reverse", row_block=9)
    for t in rev.jacobians:
        assert rev.reconstruction_error(t) < EXACT, t.name
    cumulative = [t for t in targets if "local" not in t and "to_output" not in t]
    fwd = swept(sm, prompt_ids, cumulative, mode="forward", token_block=3)
    assert fwd.plan.reverse == []
    for t in fwd.jacobians:
        assert fwd.reconstruction_error(t) < EXACT, t.name
        assert (fwd[t] - rev[t]).abs().max().item() <= EXACT * max(1.0, rev[t].abs().max().item()), t.name
    # to_output always rides on the output's reverse sweep, whatever the mode asked for
    auto = sm.plan(rev.trace, [Target.parse(t) for t in targets], mode="forward")
    assert all(t.is_to_output or t.local or t.is_output for t in auto.reverse)


def test_normed_targets_equal_autograd_of_the_frozen_norm(streamable_model: torch.nn.Module,
                                                         prompt_ids: list[int]) -> None:
    sm = StreamedEngine(streamable_model, dtype=torch.float64)
    res = swept(sm, prompt_ids, [f"{c}_normed.{i}" for i in range(sm.n_layers) for c in ("layer", "mlp")],
                       row_block=16)
    model, p = streamable_model.double(), len(prompt_ids) - 1
    x = sm.skeleton.embed(prompt_ids)
    with linearized(model) as lin:
        layers = lin.decoder.layers
        for i in range(sm.n_layers):
            def layer_normed(e: torch.Tensor, i: int = i) -> torch.Tensor:
                seen: list[torch.Tensor] = []
                handle = layers[i].register_forward_hook(lambda _m, _a, out: seen.append(_layer_output(out)))
                try:
                    lin.decoder(inputs_embeds=e[None], use_cache=False)
                finally:
                    handle.remove()
                return _frozen_norm(model, seen[0][0, p])

            J = torch.autograd.functional.jacobian(layer_normed, x)
            assert (J - res[f"layer_normed.{i}"]).abs().max().item() < EXACT, i
            # the normed Jacobian is the un-normed one scaled by the frozen norm's diagonal
            assert (res[f"mlp_normed.{i}"] - _frozen_norm(model, res.trace.base_value(
                Target(i, "mlp_normed"))).div(res.trace.base_value(Target(i, "mlp")))[:, None, None]
                    * swept(sm, prompt_ids, [f"mlp.{i}"])[f"mlp.{i}"]).abs().max().item() < 1e-10


def test_to_output_equals_autograd_from_the_layer_state(streamable_model: torch.nn.Module,
                                                       prompt_ids: list[int]) -> None:
    sm = StreamedEngine(streamable_model, dtype=torch.float64)
    res = swept(sm, prompt_ids, [f"to_output.{i}" for i in range(sm.n_layers)], row_block=16)
    assert res.plan.forward == []
    model, p, last = streamable_model.double(), len(prompt_ids) - 1, sm.n_layers - 1
    x = sm.skeleton.embed(prompt_ids)
    with linearized(model) as lin:
        layers = lin.decoder.layers
        for i in range(sm.n_layers):
            h_i = res.trace.inputs[i + 1]

            def from_state(h: torch.Tensor, i: int = i) -> torch.Tensor:  # (n, d) layer i's output -> y (d,)
                def swap(_m: torch.nn.Module, _a: object, out: object) -> object:
                    return (h[None], *out[1:]) if isinstance(out, tuple) else h[None]

                handle = layers[i].register_forward_hook(swap)
                try:
                    return lin.decoder(inputs_embeds=x[None], use_cache=False).last_hidden_state[0, p]
                finally:
                    handle.remove()

            J = torch.autograd.functional.jacobian(from_state, h_i)  # (d, n, d)
            assert (J - res[f"to_output.{i}"]).abs().max().item() < EXACT, i
    # the last layer's: diag(g) / rms(h) at the target position, zero elsewhere
    h = res.trace.inputs[last + 1][p]
    diag = torch.diag(_frozen_norm(model, h) / h)
    expected = torch.zeros_like(res[f"to_output.{last}"])
    expected[:, p] = diag
    assert (res[f"to_output.{last}"] - expected).abs().max().item() < EXACT


def test_to_output_costs_no_extra_sweep(prompt_ids: list[int]) -> None:
    from detjac.engine.checkpoints.tiny import tiny_model

    sm = StreamedEngine(tiny_model("llama", seed=3), dtype=torch.float64)
    trace = sm.trace(prompt_ids)
    plain = sm.plan(trace, [Target.parse("output")], mode="reverse", row_block=sm.d_model)
    assemble(sm, trace, plain.reverse, plain)
    before = sm.stats.layers_loaded
    assemble(sm, trace, plain.reverse, plain)
    one = sm.stats.layers_loaded - before
    every = [Target.parse("output"), *layer_targets("all", "to_output", sm.n_layers)]
    plan = sm.plan(trace, every, mode="reverse", row_block=sm.d_model)
    before = sm.stats.layers_loaded
    assemble(sm, trace, every, plan)
    assert sm.stats.layers_loaded - before == one  # the same layers, read once each, as for the output alone


def test_bad_components_name_the_valid_ones() -> None:
    for bad in ("ffn", "to_output_local", "normed"):
        with pytest.raises(InvalidArgumentError, match="to_output") as err:
            layer_targets("all", f"layer,{bad}", 4)
        assert repr(bad) in str(err.value)
    with pytest.raises(InvalidArgumentError, match="layer_normed"):
        Target.parse("to_output_local.1", 4)
    assert {"resid_mid", "layer_normed_local", "to_output"} <= set(kinds())
    assert Target.parse("mlp_normed_local.-1", 4) == Target(3, "mlp_normed", True)
    assert Target.parse("to_output.2").source_array == "input"
    assert Target.parse("attn_normed_local.2").source_array == "inputs"
