"""The layer-streamed engine keeps layers in their stored dtype and widens them only where they are used, exactly.

Every streamable family's tiny model stored in bfloat16: the streamed float64 J reconstructs to < 1e-12 and equals the
in-memory engine's (within float64 rounding), while the layers are read, held and kept as bfloat16 (bytes read are the
stored bytes). A tiny Llama as a quantized GGUF (Q4_0, Q5_1, Q8_0): the layers travel as raw blocks, and the streamed
float64 J equals the autograd Jacobian of a handwritten detached forward on weights dequantized by the ``gguf``
package's own numpy decoder (sharing no decoding code with detjac). Bad input is refused in one line before any
layer is read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_independent_jacobian import manual_detached_llama
from tiny_models import STREAMABLE

from benchmarks.support.random_weights import write_random_gguf
from detjac.engine import InMemoryEngine, StreamedEngine, jacobian, load_model
from detjac.engine.checkpoints import stored as stored_module
from detjac.engine.checkpoints.stored import Packed, check_compute_dtype, widen
from detjac.engine.checkpoints.tiny import save_tiny_checkpoint
from detjac.errors import CheckpointError, InvalidArgumentError

IDS = [5, 17, 42, 9, 77, 120, 3, 64, 150, 11, 98, 31, 7]  # longer than the tiny models' sliding window (4)
EXACT = 1e-12


@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = save_tiny_checkpoint(tmp_path_factory.mktemp(family) / family, family, seed=3,
                                                dtype=torch.bfloat16)
        return made[family]

    return get


@pytest.mark.parametrize("family", STREAMABLE)
def test_bf16_weights_stream_as_stored_and_the_float64_jacobian_is_exact(family, bf16_checkpoints):
    folder = bf16_checkpoints(family)
    sm = StreamedEngine(folder, dtype=torch.float64)
    assert sm.skeleton.stored_dtypes == {torch.bfloat16}
    assert sm.cost.stored_bytes * 4 == sm.cost.layer_bytes  # held and read ahead as bf16; widened to float64
    res = jacobian(sm, IDS)
    assert res.reconstruction_error < EXACT
    # every layer read as stored: the bytes read are the stored layers' (the final norm once, when the engine starts)
    assert sm.stats.bytes_read == sm.stats.layers_loaded * sm.cost.stored_bytes + sm.d_model * 2
    assert sm.skeleton.feed.kept == {}  # no budget: nothing kept across passes
    ref = jacobian(InMemoryEngine(load_model(folder, dtype=torch.float64)), IDS)
    assert (res.jacobian - ref.jacobian).abs().max() <= EXACT * ref.jacobian.abs().max()


def test_layers_in_flight_and_kept_are_the_stored_tensors(bf16_checkpoints):
    sm = StreamedEngine(bf16_checkpoints("llama"), dtype=torch.float64, max_memory="cpu=1GiB")
    trace = sm.trace(IDS)
    assert sm.skeleton.feed.kept and all(t.dtype == torch.bfloat16 for layer in sm.skeleton.feed.kept.values()
                                         for t in layer.values())
    sm.skeleton.load_layer(0)
    try:  # the layer in use is widened on the compute device, into tensors of its own (folded into in place)
        assert sm.layers[0].mlp.up_proj.weight.dtype == torch.float64 and 0 in sm.skeleton.owned
    finally:
        sm.skeleton.release_layer(0)
    assert trace.output.dtype == torch.float64


def _numpy_dequantized(path: Path, config) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file dequantized by the ``gguf`` package's numpy decoder, by Hugging Face name, with
    llama.cpp's Q/K row order undone as its converter defines it (written here, not taken from transformers)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    heads, kv = config.num_attention_heads, config.num_key_value_heads
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    out = {}
    for t in GGUFReader(path).tensors:
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
            tuple(int(s) for s in reversed(t.shape)))
        parts = t.name.split(".")
        if parts[0] == "blk":
            short = parts[2]
            if short in ("attn_q", "attn_k"):
                n = heads if short == "attn_q" else kv
                # llama.cpp's converter wrote reshape(n, 2, rows / n / 2, -1).swapaxes(1, 2): undone the other way
                values = values.reshape(n, values.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(values.shape)
            name = f"model.layers.{parts[1]}.{names[short]}.weight"
        else:
            name = {"token_embd": "model.embed_tokens.weight", "output_norm": "model.norm.weight",
                    "output": "lm_head.weight"}[parts[0]]
        out[name] = torch.from_numpy(values.copy()).double()
    return out


@pytest.mark.parametrize("quant", ["Q4_0", "Q5_1", "Q8_0"])
def test_a_quantized_gguf_streams_as_blocks_and_its_float64_jacobian_is_exact_for_the_dequantized_model(
        quant, tmp_path, monkeypatch):
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=320, tie_word_embeddings=True)
    path = write_random_gguf(tmp_path / f"tiny-{quant}.gguf", cfg, quant) and tmp_path / f"tiny-{quant}.gguf"
    sm = StreamedEngine(path, dtype=torch.float64)
    stored = sm.skeleton.source.read_stored("model.layers.0.self_attn.q_proj.weight")
    assert isinstance(stored, Packed) and stored.type_name == quant and stored.order is not None  # Q rows reordered
    assert sm.cost.stored_bytes < sm.cost.layer_bytes / 7  # blocks of at most 34 bytes per 32 weights, not 8 each
    res = jacobian(sm, IDS)
    assert res.reconstruction_error < EXACT
    # the independent reference: the gguf package's decoder, a handwritten detached forward, autograd
    model = load_model(path, dtype=torch.float64)
    reference = _numpy_dequantized(path, model.config)
    params = dict(model.named_parameters())
    for name, values in reference.items():
        assert torch.equal(params[name], values), name  # detjac's torch decoder and row order, bit for bit
        if name.endswith("q_proj.weight"):
            assert torch.equal(widen(sm.skeleton.source.read_stored(name), torch.float64, "cpu"), values)
            with monkeypatch.context() as m:  # decoded three rows at a time (Q's rows reordered): the same values
                m.setattr(stored_module, "DECODE_CHUNK_BYTES", 3 * values.shape[1] * 4)
                assert torch.equal(widen(sm.skeleton.source.read_stored(name), torch.float64, "cpu"), values)
    x = res.embeddings
    ref = torch.autograd.functional.jacobian(lambda e: manual_detached_llama(model, e), x, vectorize=True)
    assert (ref - res.jacobian).abs().max() <= EXACT * ref.abs().max()


def test_a_weight_stored_as_integers_is_refused_in_one_line_before_any_work(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_tiny_checkpoint(tmp_path / "int", "llama")
    file = next(folder.glob("*.safetensors"))
    tensors = load_file(file)
    key = "model.layers.1.mlp.up_proj.weight"
    tensors[key] = tensors[key].to(torch.int16)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"^Expected model\.layers\.1\.mlp\.up_proj\.weight stored as float16, "
                                              r"bfloat16, float32 or float64 .*Got torch\.int16\.$"):
        StreamedEngine(folder)


def test_a_dtype_below_the_stored_precision_is_refused_where_exactness_is_asked(bf16_checkpoints):
    folder = bf16_checkpoints("llama")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        StreamedEngine(folder, dtype=dtype)  # not asked: a float16 run of bf16 weights is the user's choice
    line = r"^Expected --dtype at least as precise as the weights as stored \(torch\.bfloat16\) for an exact "
    with pytest.raises(InvalidArgumentError, match=line + r"Jacobian\. Got torch\.float16\.$"):
        StreamedEngine(folder, dtype=torch.float16, exact=True)
    StreamedEngine(folder, dtype=torch.bfloat16, exact=True)
    check_compute_dtype({torch.float32}, torch.float64, True)
    with pytest.raises(InvalidArgumentError, match="float32"):
        check_compute_dtype({torch.float32, torch.bfloat16}, torch.bfloat16, True)


def test_decoding_crosses_the_vocabulary_in_chunks_with_the_same_tokens(monkeypatch, bf16_checkpoints):
    from detjac import singular
    from detjac.engine import decode_top

    rng = np.random.default_rng(0)
    m = rng.standard_normal((5000, 16)).astype(np.float32)
    m[7] = m[4000] = m[300]  # ties: kept in vocabulary order across chunks
    v = rng.standard_normal((16, 3))
    v[:, 0] = m[300]
    whole = singular.decode_top(v, m, 6)
    monkeypatch.setattr(singular, "VOCAB_CHUNK_BYTES", 16 * 8 * 128)  # chunks of 128 rows
    ids, scores = singular.decode_top(v, m, 6)
    assert np.array_equal(ids, whole[0]) and list(ids[0, :3]) == [7, 300, 4000]
    assert np.allclose(scores, whole[1], rtol=1e-13, atol=0)
    # the layer-streamed engine's rows, read a chunk at a time from the stored bf16 matrix, decode as the whole does
    sm = StreamedEngine(bf16_checkpoints("llama"), dtype=torch.float64)
    vectors = torch.from_numpy(rng.standard_normal((sm.d_model, 2)))
    got, _ = decode_top(vectors, sm.decoding_rows()["unembedding"], 5)
    want, _ = decode_top(vectors, sm.decoding_matrices()["unembedding"], 5)
    assert torch.equal(got, want)


def test_a_layer_whose_folded_pieces_are_refused_is_widened_again_for_torch_func(monkeypatch, bf16_checkpoints):
    """The gains were folded into the widened weights in place: the fallback must not compute with them."""
    from detjac.engine.pieces import NotAPiece
    from detjac.engine.streamed import adjoint

    folder = bf16_checkpoints("llama")
    ref = jacobian(StreamedEngine(folder, dtype=torch.float64), IDS)

    def refuse(*args, **kwargs):
        raise NotAPiece("refused by the test")

    monkeypatch.setattr(adjoint, "check_layer", refuse)
    sm = StreamedEngine(folder, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="refused by the test"):
        res = jacobian(sm, IDS)
    assert res.reconstruction_error < EXACT
    assert (res.jacobian - ref.jacobian).abs().max() <= EXACT * ref.jacobian.abs().max()
