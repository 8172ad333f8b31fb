"""Real trained decoders from GGUF files: SmolLM2-135M-Instruct (Llama) and Gemma 3 270M, dequantized to float64.

On both: the detached J reconstructs the output of natural prompts to < 1e-12; J equals the autograd Jacobian of a
detached forward written here from each architecture's definition (sharing no code with detjac); the layer-streamed
engine under a CPU budget smaller than the float64 weights gives the same J; layerwise targets reconstruct; and the
dequantized plain model computes what transformers' own (packed, float32) GGUF model computes.

A Gemma prompt longer than its 512-token sliding window is checked by products (J x, rows of J), not by forming
its J (640 x 530 x 640 in float64: minutes on 2 cores).
"""

from __future__ import annotations

import pytest
import torch
from real_models import gemma3_path, smollm2_path
from test_independent_jacobian import manual_detached_llama
from tiny_models import swept

from detjac.engine import InMemoryEngine, get_tokenizer, jacobian, load_engine, load_model
from detjac.targets import OUTPUTS, Target

pytestmark = pytest.mark.slow

# Gemma's second prompt is the shortest record of benchmarks/results/real_models.json: the findings test reads its J
# from the module's results instead of computing it again.
PROMPTS = {"smollm2": ["The capital of France is", "The bridge out of Marin is the"],
           "gemma3": ["The capital of France is", "The Gambia gained its independence from the UK in"]}
# Longer than Gemma 3's 512-token sliding window once repeated.
LONG_TEXT = ("The capital of France is Water boils at a temperature of The capital of France is The bridge out of "
             "Marin is the. ")


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    return {"smollm2": smollm2_path, "gemma3": lambda: gemma3_path(tmp_path_factory.mktemp("gemma3"))}


@pytest.fixture(scope="module")
def models(gguf_files):
    loaded = {}

    def get(name: str):
        if name not in loaded:
            path = gguf_files[name]()
            loaded[name] = (path, load_model(path, dtype=torch.float64))
        return loaded[name]

    return get


@pytest.fixture(scope="module")
def results(models):
    done = {}

    def get(name: str, prompt: str):
        if (name, prompt) not in done:
            done[name, prompt] = jacobian(InMemoryEngine(models(name)[1]), prompt)
        return done[name, prompt]

    return get


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_natural_prompts_reconstruct_in_float64(name, models, results):
    path, model = models(name)
    assert next(model.parameters()).dtype == torch.float64 and type(model).__name__.endswith("ForCausalLM")
    for prompt in PROMPTS[name]:
        res = results(name, prompt)
        assert res.jacobian.shape == (model.config.hidden_size, len(res.token_ids), model.config.hidden_size)
        assert res.reconstruction_error < 1e-12, (prompt, res.reconstruction_error)
        with torch.no_grad():  # the model's own final normed hidden state (its norms compute in float32)
            stock = model(torch.tensor([res.token_ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        assert torch.allclose(res.output, stock, rtol=0, atol=1e-6 * stock.abs().max())


def test_smollm2_predicts_paris_and_u1_decodes_to_it(models, results):
    _, model = models("smollm2")
    res = results("smollm2", "The capital of France is")
    tokenizer = get_tokenizer(model)  # the GGUF's own, kept by load_model
    assert tokenizer.decode([res.next_token_id]) == " Paris"
    J = res.jacobian.reshape(res.jacobian.shape[0], -1)  # [J_1 ... J_n]
    u1 = torch.linalg.svd(J, full_matrices=False).U[:, 0]
    scores = model.lm_head.weight @ u1
    top = set(scores.topk(10).indices.tolist()) | set((-scores).topk(10).indices.tolist())
    assert res.next_token_id in top  # u_1's sign is arbitrary


def test_smollm2_jacobian_equals_autograd_of_a_handwritten_detached_forward(models, results):
    _, model = models("smollm2")
    res = results("smollm2", "The capital of France is")
    ref_out = manual_detached_llama(model, res.embeddings)
    assert torch.allclose(ref_out, res.output, rtol=0, atol=1e-12 * res.output.abs().max())
    ref = torch.autograd.functional.jacobian(lambda x: manual_detached_llama(model, x), res.embeddings,
                                             vectorize=True)
    assert (ref - res.jacobian).abs().max() <= 1e-12 * ref.abs().max()


def _gemma_rms(x, weight, eps):
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt().detach() * (1.0 + weight)


def _gemma_rope(x, theta):  # (heads, n, hd); angles in float32, as the architecture defines them
    n, hd = x.shape[-2:]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.arange(n, dtype=torch.float32)[:, None] * inv
    ang = torch.cat([ang, ang], -1)
    rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * ang.cos().to(x.dtype) + rot * ang.sin().to(x.dtype)


def manual_detached_gemma3(model, x, window: bool = True):
    """Gemma 3's detached forward on embeddings x (n, d) (already scaled by sqrt(d)) -> the final normed last
    hidden state (d,): four norms per layer and per-head q/k norms, all w -> 1 + w; sliding layers see a window
    (``window=False``: every layer sees every earlier position, to show that a prompt is long enough to differ)."""
    cfg = model.config
    heads, kv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    n = x.shape[0]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    h = x
    for layer, kind in zip(model.model.layers, cfg.layer_types, strict=True):
        allowed = (j <= i) & ((j > i - cfg.sliding_window) if kind == "sliding_attention" and window else True)
        mask = torch.zeros(n, n, dtype=x.dtype).masked_fill(~allowed, float("-inf"))
        theta = cfg.rope_parameters[kind]["rope_theta"]
        att = layer.self_attn
        a = _gemma_rms(h, layer.input_layernorm.weight, eps)
        q = (a @ att.q_proj.weight.T).view(n, heads, hd).transpose(0, 1)
        k = (a @ att.k_proj.weight.T).view(n, kv, hd).transpose(0, 1)
        v = (a @ att.v_proj.weight.T).view(n, kv, hd).transpose(0, 1)
        q, k = _gemma_rope(_gemma_rms(q, att.q_norm.weight, eps), theta), _gemma_rope(_gemma_rms(k, att.k_norm.weight,
                                                                                                  eps), theta)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        probs = torch.softmax(q @ k.transpose(1, 2) * cfg.query_pre_attn_scalar ** -0.5 + mask, -1).detach()
        o = (probs @ v).transpose(0, 1).reshape(n, -1) @ att.o_proj.weight.T
        h = h + _gemma_rms(o, layer.post_attention_layernorm.weight, eps)
        m = _gemma_rms(h, layer.pre_feedforward_layernorm.weight, eps)
        mlp = layer.mlp
        gate = torch.nn.functional.gelu(m @ mlp.gate_proj.weight.T, approximate="tanh").detach()
        f = (gate * (m @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        h = h + _gemma_rms(f, layer.post_feedforward_layernorm.weight, eps)
    return _gemma_rms(h, model.model.norm.weight, eps)[-1]


def test_gemma3_jacobian_equals_autograd_of_a_handwritten_detached_forward(models, results):
    _, model = models("gemma3")
    res = results("gemma3", "The capital of France is")
    assert model.config.hidden_activation == "gelu_pytorch_tanh" and "full_attention" in model.config.layer_types
    assert model.model.layers[0].input_layernorm.weight.abs().max() > 0.1  # real norm weights (w, not 1 + w)
    ref_out = manual_detached_gemma3(model, res.embeddings)
    assert torch.allclose(ref_out, res.output, rtol=0, atol=1e-12 * res.output.abs().max())
    ref = torch.autograd.functional.jacobian(lambda x: manual_detached_gemma3(model, x), res.embeddings,
                                             vectorize=True)
    assert (ref - res.jacobian).abs().max() <= 1e-12 * ref.abs().max()


def test_a_gemma3_prompt_longer_than_its_sliding_window_is_exact(models):
    """Beyond 512 tokens Gemma 3's sliding layers no longer see the first positions. Forming J there (640 x 530 x
    640) takes minutes on 2 cores, so the operator is checked by products: J x reproduces the output (one
    forward-mode product), and rows of J (pullbacks) equal autograd of the hand-written detached forward."""
    from detjac.engine import as_engine
    from detjac.exactness import relative_error

    _, model = models("gemma3")
    window = model.config.sliding_window
    engine = as_engine(model)
    ids = (engine.token_ids(LONG_TEXT * 60))[: window + 18]
    assert len(ids) == window + 18
    trace = engine.trace(ids)
    x = trace.embeddings
    y, vjp = torch.func.vjp(lambda e: manual_detached_gemma3(model, e), x)  # one forward: the output and its rows
    y = y.detach()
    assert relative_error(y, trace.output) < 1e-12
    with torch.no_grad():
        windowless = manual_detached_gemma3(model, x, window=False)
    assert relative_error(windowless, y) > 1e-6  # the window matters here
    assert relative_error(engine.push(trace, x[None])[0], y) < 1e-12
    rows = torch.eye(model.config.hidden_size, dtype=torch.float64)[[0, 17, 301, 639]]
    ours = engine.pull(trace, rows)
    ref = torch.func.vmap(vjp)(rows)[0]  # the four pullbacks batched through one backward
    assert (ours - ref).abs().max() <= 1e-12 * ref.abs().max()


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_the_streamed_engine_under_a_budget_below_the_weights_equals_the_in_memory_one(name, models, results):
    path, model = models(name)
    weights = sum(p.numel() for p in model.parameters()) * 8
    assert 300 << 20 < weights / 3  # float64 weights: 1.08 GB (SmolLM2), 2.14 GB (Gemma)
    engine = load_engine(path, streamed=True, max_memory="cpu=300MiB")
    prompt = PROMPTS[name][0]
    got = swept(engine, prompt, [OUTPUTS])
    ref = results(name, prompt)
    J = got.jacobians[OUTPUTS]
    assert got.reconstruction_error("output") < 1e-12
    assert (J - ref.jacobian).abs().max() <= 1e-12 * ref.jacobian.abs().max()
    assert engine.stats.max_resident_layers == 1


def test_a_streamed_run_of_gemma3_stays_below_its_float64_weights_embedding_included(gguf_files, tmp_path):
    """The 262,144 x 640 embedding (1.34 GB in float64) is gathered by the prompt's rows and copied into the store in
    row blocks: the whole `detjac run` process peaks below the float64 weights (2.14 GB)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    path = gguf_files["gemma3"]()
    prompts = tmp_path / "p.txt"
    prompts.write_text("The bridge out of Marin is the\n")
    out = tmp_path / "s.zarr"
    detjac = Path(sys.executable).with_name("detjac")  # the console script next to this interpreter
    command = [str(detjac), "run", str(path), str(prompts), "--out", str(out), "--streamed", "--max-memory",
               "cpu=300MiB", "--dtype", "float64"]
    measure = ("import resource, subprocess, sys, json; r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
               "print(json.dumps([r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))")
    done = subprocess.run([sys.executable, "-c", measure, *command], capture_output=True, text=True, timeout=600)
    code, peak_kib = json.loads(done.stdout.strip().splitlines()[-1])
    assert code == 0, done.stderr[-2000:]
    from detjac.store import open_store

    store = open_store(out)
    assert store.model_array("embedding").shape == (262144, 640)
    assert peak_kib * 1024 < 1.6e9, f"peak RSS {peak_kib / 2**20:.2f} GiB"  # float64 weights: 2.14 GB


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_layerwise_targets_of_real_models_reconstruct(name, models, gguf_files):
    path = gguf_files[name]()
    engine = load_engine(path, streamed=True)
    last = engine.n_layers - 1
    targets = [Target(layer, kind) for layer in (0, last // 2, last) for kind in ("layer", "layer_normed", "to_output")]
    res = swept(engine, "The bridge out of", targets)
    for t in targets:
        assert res.reconstruction_error(t) < 1e-12, t.name


def test_the_dequantized_model_computes_what_transformers_gguf_model_computes(models):
    """transformers' own GGUF model keeps the weights packed and computes in float32: the same model as ours, to
    float32 rounding."""
    from transformers import AutoModelForCausalLM

    path, model = models("smollm2")
    packed = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([[504, 3575, 282, 4649, 314]])
    with torch.no_grad():
        theirs, ours = packed(ids).logits[0, -1].double(), model(ids).logits[0, -1]
    assert (theirs - ours).abs().max() <= 1e-3 * ours.abs().max()
    assert int(theirs.argmax()) == int(ours.argmax())


def test_a_store_records_the_gguf_identity_and_refuses_another_file(tmp_path):
    import hashlib
    import shutil

    from click.testing import CliRunner

    from detjac.cli.main import main
    from detjac.engine.checkpoints.gguf import read_gguf_header
    from detjac.store import open_store

    first = shutil.copy(smollm2_path(), tmp_path / "a.gguf")
    header = read_gguf_header(first)
    second = tmp_path / "b.gguf"
    data = bytearray(first.read_bytes())
    data[header.tensors["blk.29.ffn_down.weight"].begin + 7] ^= 0x10  # one quantized block's bits, another model
    second.write_bytes(bytes(data))
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hi\n")
    out = tmp_path / "s.zarr"
    result = CliRunner().invoke(main, ["run", str(first), str(prompts), "--out", str(out)])
    assert result.exit_code == 0, result.output
    run = open_store(out).run
    assert run["model_id"] == "a.gguf" and run["gguf_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert run["weights"] == {"a.gguf": hashlib.sha256(first.read_bytes()).hexdigest()}
    assert open_store(out).model_bytes("tokenizer.json")  # the GGUF's tokenizer, kept for decoding
    again = CliRunner().invoke(main, ["run", str(second), str(prompts), "--out", str(out)])
    assert again.exit_code == 1 and "a.gguf" in again.output and "b.gguf" in again.output, again.output
    assert "Traceback" not in again.output and len(open_store(out)) == 1


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_committed_findings_record_recomputes_from_its_text(name, models, results):
    """benchmarks/results/real_models.json: a record's token ids, prediction, reconstruction error and the 10 tokens
    of the combined u_1 come back from its text (its shortest record, to keep the test short; Gemma's is one of the
    natural prompts above, its J computed once)."""
    import json
    from pathlib import Path

    from detjac.engine.tools.triplets import explain

    recorded = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "real_models.json"
    rec = min(json.loads(recorded.read_text(encoding="utf-8"))[name]["prompts"], key=lambda r: len(r["token_ids"]))
    model = models(name)[1]
    res = results(name, rec["text"])  # jacobian(InMemoryEngine(model), text), as the record was made
    assert list(res.token_ids) == rec["token_ids"]
    assert res.next_token_id == rec["next_token_id"]
    assert res.reconstruction_error < 1e-12 and rec["recon_detached"] < 1e-12
    top10 = explain(res, model, k=1, top=10).combined.left_ids[0].tolist()
    assert top10 == rec["u1_top10"] and (rec["next_token_id"] in top10) == rec["u1_hit"]
