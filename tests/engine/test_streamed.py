"""The layer-streamed engine equals the in-memory engine, and its layerwise Jacobians are exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import swept

from detjac.engine import InMemoryEngine, jacobian, load_model
from detjac.engine.checkpoints.tiny import save_tiny_checkpoint, tiny_model
from detjac.engine.checkpoints.weights import SafetensorsWeights, resolve_key
from detjac.engine.memory import parse_memory
from detjac.engine.products.logits import output_logits
from detjac.engine.streamed.streamed_engine import StreamedEngine
from detjac.engine.streamed.tracing import suffix_kwargs
from detjac.errors import CheckpointError, InvalidArgumentError
from detjac.targets import Target, layer_targets

ALL_COMPONENTS = "layer,attn,mlp,layer_local,attn_local,mlp_local"
EXACT = 1e-12


def test_streamed_equals_in_memory_engine_for_every_family(streamable_model: torch.nn.Module,
                                                           prompt_ids: list[int]) -> None:
    ref = jacobian(InMemoryEngine(streamable_model), prompt_ids, row_block=16)
    sm = StreamedEngine(streamable_model, dtype=torch.float64)
    res = swept(sm, prompt_ids, ["output"], row_block=7)  # blocks that do not divide d_model
    assert (res["output"] - ref.jacobian).abs().max().item() <= EXACT
    assert sm.stats.pulled_suffix_layers >= res.plan.n_blocks  # at least the top layer, from the last position only
    assert res.reconstruction_error("output") < EXACT
    assert torch.allclose(sm.logits(res.trace.output), ref.logits, rtol=0, atol=1e-12)
    assert int(sm.logits(res.trace.output).argmax()) == ref.next_token_id


def test_layerwise_targets_reconstruct_in_both_modes(streamable_model: torch.nn.Module, prompt_ids: list[int]) -> None:
    sm = StreamedEngine(streamable_model, dtype=torch.float64)
    targets = ["output", *(t.name for t in layer_targets("all", ALL_COMPONENTS, sm.n_layers))]
    rev = swept(sm, prompt_ids, targets, mode="reverse", row_block=9)
    fwd = swept(sm, prompt_ids, [t for t in targets if "local" not in t], mode="forward", token_block=3)
    assert rev.plan.forward == [] and fwd.plan.reverse == []
    assert sm.stats.pulled_suffix_layers >= rev.plan.n_blocks  # the top layer (more below a sliding window)
    for t in rev.jacobians:
        assert rev.reconstruction_error(t) < EXACT, t.name
    assert sm.stats.suffix_layers > 0  # token blocks after the first carried their suffix only
    for t in fwd.jacobians:
        assert fwd.reconstruction_error(t) < EXACT, t.name
        scale = rev[t].abs().max().item()
        assert (fwd[t] - rev[t]).abs().max().item() <= EXACT * max(1.0, scale), t.name
    # the residual stream decomposes: layer.L = layer.(L-1) + attn.L + mlp.L (input embeddings at L = 0)
    last = sm.n_layers - 1
    before = rev[f"layer.{last - 1}"]
    summed = before + rev[f"attn.{last}"] + rev[f"mlp.{last}"]
    assert (summed - rev[f"layer.{last}"]).abs().max().item() < 1e-10


@pytest.mark.slow
def test_forward_mode_truncation_at_an_earlier_position_and_without_detaching(prompt_ids: list[int]) -> None:
    model = tiny_model("mistral", seed=2)  # a sliding window shorter than the prompt
    ref = swept(StreamedEngine(model), prompt_ids, ["layer.1", "output"], mode="reverse", position=3)
    sm = StreamedEngine(model)
    fwd = swept(sm, prompt_ids, ["layer.1", "output"], mode="forward", token_block=2, position=3)
    for t in fwd.jacobians:
        assert (fwd[t] - ref[t]).abs().max().item() <= EXACT, t.name
        assert not fwd[t][:, 4:].any(), t.name  # tokens after the target position do not reach it
    assert sm.stats.suffix_layers > 0
    ordinary = StreamedEngine(model, detach=False)  # no frozen probabilities: never truncated
    exact = swept(ordinary, prompt_ids, ["layer.1"], mode="forward", token_block=2)
    assert ordinary.stats.suffix_layers == 0
    swept(ordinary, prompt_ids, ["output"], mode="reverse")
    assert ordinary.stats.pulled_suffix_layers == 0
    assert (exact["layer.1"] - swept(ordinary, prompt_ids, ["layer.1"], mode="reverse")["layer.1"]
            ).abs().max().item() <= EXACT


def test_suffix_arguments_slice_positions_and_refuse_unknown_ones() -> None:
    n = 5
    kwargs = {"attention_mask": torch.zeros(1, 1, n, n), "position_ids": torch.arange(n)[None],
              "position_embeddings": (torch.ones(1, n, 4), torch.ones(1, n, 4)), "past_key_values": None,
              "use_cache": False}
    sliced = suffix_kwargs(kwargs, 2, n)
    assert sliced["attention_mask"].shape == (1, 1, 3, n)
    assert sliced["position_ids"].tolist() == [[2, 3, 4]]
    assert [t.shape for t in sliced["position_embeddings"]] == [(1, 3, 4)] * 2
    assert suffix_kwargs({**kwargs, "cache_position": torch.arange(n)}, 2, n) is None


def test_ordinary_jacobian_matches_in_memory_engine(prompt_ids: list[int]) -> None:
    model = tiny_model("qwen3", seed=3)
    ref = jacobian(InMemoryEngine(model, detach=False), prompt_ids, check=False)
    res = swept(StreamedEngine(model, detach=False), prompt_ids, ["output"])
    assert (res["output"] - ref.jacobian).abs().max().item() <= EXACT


@pytest.mark.parametrize("model_type", ["llama", "gemma3", "phi3"])
def test_streaming_from_safetensors_matches_loaded_model(tmp_path: Path, model_type: str,
                                                         prompt_ids: list[int]) -> None:
    path = save_tiny_checkpoint(tmp_path / model_type, model_type, dtype=torch.bfloat16)
    model = load_model(path, dtype=torch.float64)
    ref = jacobian(InMemoryEngine(model), prompt_ids)
    sm = StreamedEngine(path, dtype=torch.float64)
    res = swept(sm, prompt_ids, ["output", "layer.0", "mlp_local.1"], row_block=16)
    assert (res["output"] - ref.jacobian).abs().max().item() <= EXACT
    assert res.reconstruction_error("layer.0") < EXACT and res.reconstruction_error("mlp_local.1") < EXACT
    with torch.no_grad():
        stock = output_logits(model, ref.output)
    assert torch.allclose(sm.logits(res.trace.output), stock, rtol=0, atol=1e-12)
    assert sm.tokenizer is not None
    assert swept(sm, "The bridge", ["output"]).trace.token_ids == sm.tokenizer("The bridge")["input_ids"]


def test_layers_are_streamed_one_at_a_time_and_released(llama_checkpoint: Path, prompt_ids: list[int]) -> None:
    sm = StreamedEngine(llama_checkpoint)
    res = swept(sm, prompt_ids, ["output"], row_block=16)
    n_blocks = -(-sm.d_model // 16)
    assert res.plan.n_row_blocks == n_blocks
    assert sm.stats.max_resident_layers == 1 and not sm.stats.resident
    assert sm.stats.layers_loaded == sm.n_layers * (1 + n_blocks)  # forward pass, then one sweep per block
    for layer in sm.layers:
        assert all(p.device.type == "meta" for p in layer.parameters())
    # bytes read: every layer once per sweep (float32 on disk), the norm once; never the whole file at once
    layer_bytes = sum(p.numel() for p in sm.layers[0].parameters()) * 4
    assert sm.stats.bytes_read == sm.stats.layers_loaded * layer_bytes + sm.d_model * 4


def test_memory_budget_sizes_blocks_and_refuses_too_little(llama_checkpoint: Path, prompt_ids: list[int]) -> None:
    assert parse_memory("cuda:0=8GiB, cpu=1.5GB") == {"cuda:0": 8 * 2**30, "cpu": 1_500_000_000}
    assert parse_memory("cuda=512MiB") == {"cuda:0": 512 * 2**20}
    with pytest.raises(InvalidArgumentError, match="DEVICE=SIZE"):
        parse_memory("eight gigs")
    with pytest.raises(InvalidArgumentError, match="torch device"):
        parse_memory("gpu=8GiB")
    with pytest.raises(InvalidArgumentError, match="cpu twice"):
        parse_memory("cpu=8GiB,CPU=32GiB")
    other = "compute device cpu" if torch.cuda.is_available() else "this PyTorch can compute on"
    with pytest.raises(InvalidArgumentError, match=other):  # a budget for another device only (one this lacks)
        StreamedEngine(llama_checkpoint, max_memory="cuda:0=8GiB")
    roomy = StreamedEngine(llama_checkpoint, max_memory="cpu=1GiB")
    trace = roomy.trace(prompt_ids)
    assert roomy.plan(trace, [Target(-1, "output")]).row_block == roomy.d_model  # everything fits: one sweep
    sm = StreamedEngine(llama_checkpoint)
    one_vector = sm.cost.vector_bytes(len(prompt_ids))
    # room for exactly 5 vectors besides the layers (two as stored, one widened), the hidden states and what a
    # layer's crossing holds
    budget = sm.cost.weights_bytes + sm.cost.block_bytes(len(prompt_ids), 0) + 5 * one_vector
    tight = StreamedEngine(llama_checkpoint, max_memory={"cpu": budget})
    assert tight.plan(trace, [Target(-1, "output")]).row_block == 5
    res = swept(tight, prompt_ids, ["output"])
    assert res.plan.row_block == 5 and res.reconstruction_error("output") < EXACT
    d = sm.d_model  # room for 60 % of the rows: two even blocks, not one full and one short
    evened = StreamedEngine(llama_checkpoint, max_memory={"cpu": budget + (d * 6 // 10 - 5) * one_vector})
    assert evened.plan(trace, [Target(-1, "output")]).row_block == -(-d // 2)
    with pytest.raises(InvalidArgumentError, match="raise --max-memory"):  # refused on load, before any work
        StreamedEngine(llama_checkpoint, max_memory={"cpu": sm.skeleton.layer_bytes()})


def test_cost_model_picks_the_cheaper_mode() -> None:
    model = tiny_model("llama", seed=1, num_hidden_layers=6)
    sm = StreamedEngine(model)
    everything = layer_targets("all", "layer,attn,mlp", sm.n_layers)
    short = sm.trace([5, 9])  # 2 tokens, 6 layers: forward mode is cheaper
    plan = sm.plan(short, everything)
    assert plan.forward == everything and plan.forward_cost < plan.reverse_cost
    long = sm.trace(list(range(3, 43)))  # 40 tokens: reverse mode is cheaper
    plan = sm.plan(long, everything)
    assert plan.reverse == everything and plan.reverse_cost < plan.forward_cost
    local = layer_targets([2], "attn_local", sm.n_layers)
    assert sm.plan(short, local, mode="forward").forward == []  # per-layer targets always go in reverse


def test_targets_parse_and_refuse_bad_names() -> None:
    assert Target.parse("attn_local.-1", 4) == Target(3, "attn", True)
    assert Target.parse("attn_local.-1", 4).name == "attn_local.3"
    assert [t.name for t in layer_targets("0,2", "mlp", 4)] == ["mlp.0", "mlp.2"]
    for bad in ("attention.1", "layer", "layer.x"):
        with pytest.raises(InvalidArgumentError, match="Expected a target"):
            Target.parse(bad, 4)
    with pytest.raises(InvalidArgumentError, match="layer index"):
        Target.parse("layer.4", 4)
    with pytest.raises(InvalidArgumentError, match="--layers"):
        layer_targets("first", "layer", 4)
    with pytest.raises(InvalidArgumentError, match="components among"):
        layer_targets("all", "layer,ffn", 4)


def test_checkpoint_keys_resolve_across_nesting_and_refuse_ambiguity(tmp_path: Path) -> None:
    keys = ["language_model.model.layers.0.mlp.up_proj.weight",
            "vision_tower.vision_model.encoder.layers.0.mlp.up_proj.weight"]
    assert resolve_key("model.language_model.layers.0.mlp.up_proj.weight", keys) == keys[0]
    with pytest.raises(CheckpointError, match="none"):
        resolve_key("model.layers.1.mlp.up_proj.weight", keys)
    with pytest.raises(CheckpointError, match="several"):
        resolve_key("model.layers.0.mlp.up_proj.weight", [*keys, "other.model.layers.0.mlp.up_proj.weight"])
    with pytest.raises(CheckpointError, match="safetensors"):
        SafetensorsWeights(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="readable safetensors"):
        SafetensorsWeights(tmp_path)
