"""bitsandbytes-quantized weights as plain float tensors (detjac.engine.checkpoints.quantized), on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

bnb = pytest.importorskip("bitsandbytes")

import bitsandbytes.functional as bnbf  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tiny_models import swept  # noqa: E402
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from detjac.engine import InMemoryEngine, jacobian  # noqa: E402
from detjac.engine.checkpoints.quantized import (  # noqa: E402
    QUANT_METHODS,
    dequantize_layer,
    is_quantized_checkpoint,
    quantize_roundtrip,
)
from detjac.errors import CheckpointError, InvalidArgumentError, UnsupportedModelError  # noqa: E402

# On CPUs with AVX512-BF16, bitsandbytes' 4-bit inference path (eval mode, no grad) repacks
# the weight and rounds its block scales to bfloat16; training mode keeps the plain decode.
CPU_REPACKS_4BIT = bool(bnbf.has_avx512bf16())

# (name, method, double quantization, BitsAndBytesConfig kwargs)
VARIANTS = [
    ("nf4", "nf4", False, {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}),
    ("nf4-dq", "nf4", True, {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}),
    ("fp4", "fp4", False, {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}),
    ("int8", "int8", False, {"load_in_8bit": True}),
]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LAYER = "model.layers.1."


def _linear(method: str, weight: torch.Tensor, bias: torch.Tensor | None, double_quant: bool) -> torch.nn.Module:
    """A bitsandbytes layer quantized on CPU from ``weight``, as transformers builds them."""
    out_f, in_f = weight.shape
    if method == "int8":
        lin = bnb.nn.Linear8bitLt(in_f, out_f, bias=bias is not None, has_fp16_weights=False, threshold=6.0)
        lin.weight = bnb.nn.Int8Params(weight.clone(), requires_grad=False, has_fp16_weights=False)
    else:
        lin = bnb.nn.Linear4bit(in_f, out_f, bias=bias is not None, compute_dtype=weight.dtype,
                                compress_statistics=double_quant, quant_type=method)
        lin.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, compress_statistics=double_quant,
                                       quant_type=method, module=lin)
    if bias is not None:
        lin.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
    return lin.to("cpu")  # quantizes


def _module_weight(mod: torch.nn.Module) -> torch.Tensor:
    """The float32 weight a loaded bitsandbytes layer decodes, from its own state."""
    if isinstance(mod, bnb.nn.Linear8bitLt):
        return mod.weight.data.float() * (mod.weight.SCB.float()[:, None] / 127.0)
    state = mod.weight.quant_state
    return bnbf.dequantize_4bit(mod.weight.data, state).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method,double_quant", [("nf4", False), ("nf4", True), ("fp4", False), ("int8", False)])
def test_roundtrip_is_what_the_bnb_layer_computes_with(method: str, double_quant: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(2, 5, 64, generator=g).to(dtype)
    rt = quantize_roundtrip(w, method, double_quant=double_quant)
    assert rt.dtype == dtype and rt.shape == w.shape
    assert not torch.equal(rt, w)  # it did quantize
    assert (rt.float() - w.float()).abs().max() < (0.6 if method != "int8" else 0.05) * w.float().abs().max()
    lin = _linear(method, w, b, double_quant)
    lin.train()  # int8: the weight-dequantizing path on CPU; 4-bit: never the AVX512-BF16 repack
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, rt, b))
        if method != "int8" and not CPU_REPACKS_4BIT:
            lin.eval()
            torch.testing.assert_close(lin(x), F.linear(x, rt, b))


def test_int8_inference_also_quantizes_activations() -> None:
    """LLM.int8() in eval mode rounds its input to int8: close to, but not, the plain layer."""
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(96, 64, generator=g), torch.randn(5, 64, generator=g)
    lin = _linear("int8", w, None, False).eval()
    with torch.no_grad():
        y, y_plain = lin(x), F.linear(x, quantize_roundtrip(w, "int8"))
    err = (y - y_plain).abs().max() / y_plain.abs().max()
    assert 1e-4 < err < 0.05


def test_roundtrip_float64_matches_float32_and_rejects_bad_arguments() -> None:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    for method in QUANT_METHODS:
        r64 = quantize_roundtrip(w.double(), method)
        assert r64.dtype == torch.float64
        assert torch.equal(r64, quantize_roundtrip(w, method).double())
    with pytest.raises(InvalidArgumentError, match=r"Expected a quantization method in .*Got 'int4'"):
        quantize_roundtrip(w, "int4")
    with pytest.raises(InvalidArgumentError, match="2-D"):
        quantize_roundtrip(w[0], "nf4")
    with pytest.raises(InvalidArgumentError, match="blocksize"):
        quantize_roundtrip(w, "nf4", blocksize=48)


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("quant") / "float"
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("name,method,double_quant,qkwargs", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_saved_bnb_checkpoint_dequantizes_to_the_loaded_model(
    float_checkpoint: tuple[Path, LlamaForCausalLM], tmp_path: Path,
    name: str, method: str, double_quant: bool, qkwargs: dict,
) -> None:
    src, float_model = float_checkpoint
    qmodel = LlamaForCausalLM.from_pretrained(src, quantization_config=BitsAndBytesConfig(**qkwargs),
                                              device_map="cpu", dtype=torch.float32)
    qmodel.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert is_quantized_checkpoint(config) == method
    raw = load_file(tmp_path / "model.safetensors")

    layer = {k[len(LAYER):]: v for k, v in raw.items() if k.startswith(LAYER)}
    if method == "int8":
        assert layer["self_attn.q_proj.weight"].dtype == torch.int8
        assert {"self_attn.q_proj.SCB", "self_attn.q_proj.weight_format"} <= layer.keys()
    else:
        assert layer["self_attn.q_proj.weight"].dtype == torch.uint8
        aux = {"absmax", "quant_map", f"quant_state.bitsandbytes__{method}"}
        if double_quant:
            aux |= {"nested_absmax", "nested_quant_map"}
        assert {k[len("self_attn.q_proj.weight."):] for k in layer if k.startswith("self_attn.q_proj.weight.")} == aux

    plain = dequantize_layer(layer, torch.float32)
    expected_keys = {f"{m}.weight" for m in LINEARS} | {"input_layernorm.weight", "post_attention_layernorm.weight"}
    assert set(plain) == expected_keys
    qlayer, flayer = qmodel.model.layers[1], float_model.model.layers[1]
    for m in LINEARS:
        got = plain[f"{m}.weight"]
        assert got.dtype == torch.float32 and got.shape == flayer.get_submodule(m).weight.shape
        torch.testing.assert_close(got, _module_weight(qlayer.get_submodule(m)), rtol=0, atol=1e-6)
        # ... and equals the weight quantized on load from the float checkpoint
        rt = quantize_roundtrip(flayer.get_submodule(m).weight.detach(), method, double_quant=double_quant)
        torch.testing.assert_close(got, rt, rtol=0, atol=1e-6)
    assert torch.equal(plain["input_layernorm.weight"], flayer.input_layernorm.weight.detach())
    assert dequantize_layer(layer, torch.float64)["mlp.up_proj.weight"].dtype == torch.float64

    # The whole checkpoint, decoded into a float model, reproduces the quantized model's logits.
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(6))
    state = dequantize_layer(raw, torch.float32)
    rebuilt = LlamaForCausalLM(float_model.config).eval()
    missing, unexpected = rebuilt.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    qmodel.train()  # the dequantizing paths on every CPU (see CPU_REPACKS_4BIT, and int8 activations)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, qmodel(ids).logits, rtol=1e-5, atol=1e-5)


def test_dequantize_layer_errors_and_plain_layers() -> None:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))
    packed, state = bnbf.quantize_4bit(w, quant_type="nf4")
    tensors = {f"q.weight.{k}": v for k, v in state.as_dict(packed=True).items()} | {"q.weight": packed}
    torch.testing.assert_close(dequantize_layer(tensors, torch.float32)["q.weight"], quantize_roundtrip(w, "nf4"),
                               rtol=0, atol=0)
    # float-only layers need no bitsandbytes state and are just cast
    assert dequantize_layer({"norm.weight": w[0]}, torch.float64)["norm.weight"].dtype == torch.float64
    with pytest.raises(CheckpointError, match="q.weight.quant_map"):
        dequantize_layer({k: v for k, v in tensors.items() if not k.endswith("quant_map")}, torch.float32)
    with pytest.raises(CheckpointError, match="packed quant_state"):
        dequantize_layer({"q.weight": packed, "q.weight.absmax": state.absmax}, torch.float32)
    with pytest.raises(CheckpointError, match="bare torch.uint8"):
        dequantize_layer({"q.weight": packed}, torch.float32)
    with pytest.raises(InvalidArgumentError, match="floating"):
        dequantize_layer(tensors, torch.int32)
    cb, scb, _ = bnbf.int8_vectorwise_quant(w.half())
    with pytest.raises(UnsupportedModelError, match="row-major"):
        dequantize_layer({"q.weight": cb, "q.SCB": scb, "q.weight_format": torch.tensor(1, dtype=torch.uint8)},
                         torch.float32)


def test_is_quantized_checkpoint() -> None:
    assert is_quantized_checkpoint({}) is None
    assert is_quantized_checkpoint({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}) \
        == "fp4"  # transformers' default 4-bit type
    assert is_quantized_checkpoint({"quantization_config": {"load_in_8bit": True}}) == "int8"
    with pytest.raises(UnsupportedModelError, match="'gptq'"):
        is_quantized_checkpoint({"quantization_config": {"quant_method": "gptq", "bits": 4}})


def _rounded_model(float_model: LlamaForCausalLM, method: str) -> LlamaForCausalLM:
    """A float64 copy of ``float_model`` whose decoder-layer linear weights went through ``method``."""
    model = LlamaForCausalLM(float_model.config).eval()
    model.load_state_dict(float_model.state_dict())
    model = model.to(torch.float64)
    for layer, flayer in zip(model.model.layers, float_model.model.layers, strict=True):
        for m in LINEARS:
            w = quantize_roundtrip(flayer.get_submodule(m).weight.detach(), method)
            layer.get_submodule(m).weight.data.copy_(w.to(torch.float64))
    return model


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_streamed_quantize_on_load_is_exact_for_the_quantized_model(
    float_checkpoint: tuple[Path, LlamaForCausalLM], method: str,
) -> None:
    from detjac.engine.streamed.streamed_engine import StreamedEngine

    src, float_model = float_checkpoint
    ids = [3, 17, 42, 5, 9, 30]
    sm = StreamedEngine(src, dtype=torch.float32, quantize=method)
    res = swept(sm, ids, ["output"], row_block=16)
    # float32 compute: the streamed model quantizes the float32 weights exactly as bnb would
    ref32 = jacobian(InMemoryEngine(_rounded_model(float_model, method).to(torch.float32)), ids, check=False)
    torch.testing.assert_close(res["output"], ref32.jacobian, rtol=1e-5, atol=1e-5)
    # float64 compute on the same quantized weights reconstructs within 1e-12
    res64 = swept(StreamedEngine(src, dtype=torch.float64, quantize=method), ids, ["output", "layer.0"])
    ref64 = jacobian(InMemoryEngine(_rounded_model(float_model, method)), ids, check=False)
    assert (res64["output"] - ref64.jacobian).abs().max().item() <= 1e-12
    assert res64.reconstruction_error("output") < 1e-12 and res64.reconstruction_error("layer.0") < 1e-12


def test_streamed_reads_a_saved_4bit_checkpoint(float_checkpoint: tuple[Path, LlamaForCausalLM],
                                                tmp_path: Path) -> None:
    from detjac.engine.streamed.streamed_engine import StreamedEngine

    src, float_model = float_checkpoint
    qmodel = LlamaForCausalLM.from_pretrained(src, quantization_config=BitsAndBytesConfig(**VARIANTS[0][3]),
                                              device_map="cpu", dtype=torch.float32)
    qmodel.save_pretrained(tmp_path)
    ids = [1, 2, 60, 33, 8]
    sm = StreamedEngine(tmp_path, dtype=torch.float64)
    assert sm.source.quantized == "nf4"
    res = swept(sm, ids, ["output"])
    ref = jacobian(InMemoryEngine(_rounded_model(float_model, "nf4")), ids, check=False)
    assert (res["output"] - ref.jacobian).abs().max().item() <= 1e-12
    assert res.reconstruction_error("output") < 1e-12
    with pytest.raises(InvalidArgumentError, match="already quantized"):
        StreamedEngine(tmp_path, quantize="nf4")
