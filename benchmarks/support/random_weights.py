"""A random checkpoint at a real model's shape, written to disk as sharded safetensors one tensor at a time (never
the whole model in memory): what the streamed engine's benchmarks and the GPU check load, layer by layer, when a
model must not fit in memory. Its weights are random (normal, std 0.02; norms 1): its Jacobians are exact but say
nothing about language."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from detjac.engine.checkpoints.tiny import tiny_config

POOL = 1 << 24  # random values drawn once, then sliced at random offsets: billions of draws would take minutes


def write_random_checkpoint(folder: Path, cfg: Mapping[str, Any], dtype: Any, shard_gib: float = 2.0) -> int:
    """Write a random checkpoint of ``cfg`` (``model_type`` and the config's fields) into ``folder``.

    Parameters
    ----------
    folder : Path
        Created if missing; receives ``config.json``, ``model-NNNNN.safetensors`` shards and their index.
    cfg : mapping
        ``model_type`` (a supported family) and the config fields that differ from its tiny config.
    dtype : torch.dtype
        The stored weights' dtype (also written as the config's ``dtype``).
    shard_gib : float
        A shard is closed once it holds this many GiB.

    Returns
    -------
    int
        The weights' total size in bytes.
    """
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = tiny_config(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    config.dtype = dtype
    config.save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(POOL, generator=gen) * 0.02).to(dtype)
    shard: dict[str, Any] = {}
    size = index = total = 0
    weight_map: dict[str, str] = {}
    names = [n for n, _ in skeleton.named_parameters()]  # tied weights once
    for name, p in skeleton.named_parameters():
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=dtype)
        else:
            n = p.numel()
            start = int(torch.randint(0, pool.numel(), (1,), generator=gen))
            t = pool.roll(-start).repeat(-(-n // pool.numel()))[:n].reshape(p.shape).clone()
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= shard_gib * 2**30 or name == names[-1]:
            file = f"model-{index:05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            total += size
            shard, size, index = {}, 0, index + 1
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=1) + "\n")
    return total


# Hugging Face Llama names -> llama.cpp's (the GGUF tensor names transformers maps back)
_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_random_gguf(path: Path, cfg: Mapping[str, Any], quant: str = "Q8_0") -> int:
    """Write a random Llama-family GGUF of ``cfg`` (as :func:`write_random_checkpoint` takes it) to ``path``: every
    matrix quantized to ``quant`` by the ``gguf`` package's own quantizer (norms float32), a byte-level token list of
    the vocabulary's size (placeholder tokens past the 256 bytes: its Jacobians say nothing about language). The
    weights are drawn as :func:`write_random_checkpoint` draws them (float32). Returns the file's size in bytes."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    if cfg["model_type"] != "llama":
        raise ValueError(f"Expected a llama config for a random GGUF. Got {cfg['model_type']!r}.")
    config = tiny_config("llama", **{k: v for k, v in cfg.items() if k != "model_type"})
    kind = GGMLQuantizationType[quant]
    d, heads = config.hidden_size, config.num_attention_heads
    hd = getattr(config, "head_dim", None) or d // heads
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(d)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]) if getattr(config, "rope_parameters", None)
                         else 10000.0)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(_byte_tokens(config.vocab_size))
    w.add_token_merges(["! !"])
    w.add_bos_token_id(0)
    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(POOL, generator=gen) * 0.02).float()

    def draw(shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        start = int(torch.randint(0, pool.numel(), (1,), generator=gen))
        return pool.roll(-start).repeat(-(-n // pool.numel()))[:n].reshape(shape).numpy()

    def add(name: str, values: np.ndarray, matrix: bool) -> None:
        if matrix:
            w.add_tensor(name, quantize(values, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, values.astype(np.float32), raw_dtype=GGMLQuantizationType.F32)

    add("token_embd.weight", draw((config.vocab_size, d)), True)
    shapes = {"attn_q": (heads * hd, d), "attn_k": (config.num_key_value_heads * hd, d),
              "attn_v": (config.num_key_value_heads * hd, d), "attn_output": (d, heads * hd),
              "ffn_gate": (config.intermediate_size, d), "ffn_up": (config.intermediate_size, d),
              "ffn_down": (d, config.intermediate_size)}
    for i in range(config.num_hidden_layers):
        for short in _GGUF_NAMES.values():
            if short.endswith("norm"):
                add(f"blk.{i}.{short}.weight", np.ones(d, np.float32), False)
            else:
                add(f"blk.{i}.{short}.weight", draw(shapes[short]), True)
    add("output_norm.weight", np.ones(d, np.float32), False)
    if not config.tie_word_embeddings:
        add("output.weight", draw((config.vocab_size, d)), True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.stat().st_size


def _byte_tokens(vocab: int) -> list[str]:
    """GPT-2's byte-level alphabet (256 characters), the one merge's result ``!!``, then placeholders to ``vocab``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    alphabet = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]
    tokens = [*alphabet, "!!"]
    return tokens + [f"<t{i}>" for i in range(vocab - len(tokens))]
