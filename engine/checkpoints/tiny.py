"""Tiny random models of every supported family (d_model 32, 3 layers), for tests, demos and quick checks.

Each config exercises its family's peculiarities; nothing is downloaded. Details: docs/engine.md, "Tiny random
models"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

WINDOW = 4  # sliding window of the tiny configs: shorter than the prompts tests use

_COMMON: dict[str, Any] = dict(
    vocab_size=160, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)

_EXTRA: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": dict(head_dim=8, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "gemma3_text": dict(head_dim=8, query_pre_attn_scalar=16, sliding_window=WINDOW,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "phi3": dict(partial_rotary_factor=0.5),
    "mistral": dict(sliding_window=WINDOW),
    "olmo2": {},
    # soft-capping small enough to bite: attention scores reach ~1, logits ~2
    "gemma2": dict(head_dim=8, query_pre_attn_scalar=16, sliding_window=WINDOW, attn_logit_softcapping=1.0,
                   final_logit_softcapping=2.0, layer_types=["sliding_attention", "full_attention",
                                                            "sliding_attention"]),
    # affine families: biases, LayerNorm, ungated activations, learned position embeddings
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "gpt2": dict(n_inner=48),
    "bert": dict(hidden_act="gelu"),
    # mixture of experts: 2 of 4 experts per token
    "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
}
# Multimodal Gemma3 (the released 4B+ checkpoints): a tiny vision tower around the text model.
_GEMMA3_VISION: dict[str, Any] = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, image_size=28, patch_size=14)

_TEXT = (
    "The bridge out of Marin is the Golden Gate Bridge. The fog rolls over the bay in the "
    "morning and the ferries cross to the city. A river runs to the sea, and the sea is wide "
    "and cold. The model reads the prompt and predicts the next word of the sentence. "
)


def tiny_model_types() -> list[str]:
    """The ``model_type`` values :func:`tiny_config` knows."""
    return [*_EXTRA, "gemma3"]


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A small transformers config of ``model_type`` (see module docstring)."""
    from transformers import AutoConfig

    if model_type == "gemma3":
        text = tiny_config("gemma3_text", **overrides).to_dict()
        return AutoConfig.for_model("gemma3", text_config=text, vision_config=_GEMMA3_VISION,
                                    mm_tokens_per_image=4, image_token_index=5, boi_token_index=6,
                                    eoi_token_index=7)
    if model_type not in _EXTRA:
        raise KeyError(f"Expected one of {', '.join(tiny_model_types())}. Got {model_type!r} instead.")
    return AutoConfig.for_model(model_type, **{**_COMMON, **_EXTRA[model_type], **overrides})


def tiny_model(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float64,
               scale: float = 0.1, **overrides: Any) -> nn.Module:
    """A random causal LM (base model for an encoder) of ``model_type`` with every parameter perturbed, in eval mode."""
    from transformers import AutoModel, AutoModelForCausalLM

    from ..families import family_for

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    family = family_for(config)
    auto = AutoModel if family.encoder else AutoModelForCausalLM
    model = auto.from_config(config)
    if family.moes:  # the stock grouped_mm experts reject float64; eager is the loop detjac mirrors
        model.set_experts_implementation("eager")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            if family.moes and name.endswith("mlp.gate.weight"):
                p.mul_(10.0)  # routers that tell tokens apart: a zero-initialised router sends all to one pair
    return model.to(dtype).eval()


def tiny_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer trained on a built-in sentence set (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def save_tiny_checkpoint(path: str | Path, model_type: str = "llama", *, seed: int = 0,
                         dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    """Write a tiny random checkpoint (safetensors + tokenizer) of ``model_type`` to ``path``."""
    tok = tiny_tokenizer()
    model = tiny_model(model_type, seed=seed, dtype=dtype, vocab_size=len(tok), **overrides)
    path = Path(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
