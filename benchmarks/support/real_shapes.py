"""The shapes of real models (their config.json's shape fields), which the benchmarks rehearse at full size with
random weights (:func:`benchmarks.support.random_weights.write_random_checkpoint`) and the GPU check plans:
torch-free, so a benchmark reads them before anything heavy is imported."""

from __future__ import annotations

from typing import Any

_LLAMA3 = dict(model_type="llama", num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
               max_position_embeddings=131072)
REAL_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "head_dim": 64, "tie_word_embeddings": True},
    "llama-3.1-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "head_dim": 128, "tie_word_embeddings": False},
    "llama-3.3-70b": {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "head_dim": 128, "tie_word_embeddings": False},
    "smollm2-135m": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                     "tie_word_embeddings": True, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                     "max_position_embeddings": 8192},
}
