"""What every step of the GPU check shares (:mod:`benchmarks.gpu_check`): the shapes and sizes of a real run and
of the dry run, the step's partial results, clocks and memory peaks on the device, and the random checkpoints,
written once under ``--tmp`` and reused by a rerun."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .real_shapes import REAL_SHAPES

EXACT = 1e-12

# Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json) and Llama-3.3-70B (3 of its 80 layers).
LLAMA31_8B: dict[str, Any] = REAL_SHAPES["llama-3.1-8b"]
LLAMA33_70B: dict[str, Any] = {**REAL_SHAPES["llama-3.3-70b"], "num_hidden_layers": 3, "tie_word_embeddings": True}
LAYERS_70B = 80
# --dry-run: the same structure (GQA, several row blocks under the budget) at CPU sizes.
DRY_8B: dict[str, Any] = {**LLAMA31_8B, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 6144,
                          "max_position_embeddings": 256}
DRY_70B: dict[str, Any] = {**LLAMA33_70B, "hidden_size": 96, "intermediate_size": 256, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 6144, "max_position_embeddings": 256}
# A GGUF of Q4_0 blocks at Llama-3.3-70B's layer shape, 2 of its 80 layers. Its vocabulary is cut to 32,768: the
# embedding table is only gathered from (tied, so no unembedding is read for the output's J), and quantizing it with
# the gguf package's quantizer (single-threaded numpy) is most of the file's writing time.
Q4_70B: dict[str, Any] = {**LLAMA33_70B, "num_hidden_layers": 2, "vocab_size": 32768}
DRY_Q4: dict[str, Any] = {**DRY_70B, "num_hidden_layers": 2, "vocab_size": 512}  # Q4_0: rows a multiple of 32
# SmolLM2-135M's shape with random weights (the real 98 MB GGUF cannot travel to the GPU machine), for the graph.
SMOLLM2: dict[str, Any] = REAL_SHAPES["smollm2-135m"]
DRY_SMOLLM2: dict[str, Any] = {**SMOLLM2, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
                               "max_position_embeddings": 256}
FAMILIES = ("llama", "qwen3", "gemma3", "phi3", "olmo2", "qwen3_moe")


def sizes(dry: bool) -> dict[str, Any]:
    """Shapes, lengths and budgets of a real run, or of the dry run (same code paths, CPU sizes)."""
    if dry:
        return {"8b": DRY_8B, "70b": DRY_70B, "q4": DRY_Q4, "smollm2": DRY_SMOLLM2, "short": 8, "long": 12,
                "svd_tokens": 24, "budget": None, "budgets": None, "svd_budget": "64MiB", "matmul": 256,
                "exact_tokens": 6, "reference_lengths": [8, 12], "graph": {"tokens": 6, "max_nodes": 16, "heads": 4}}
    return {"8b": LLAMA31_8B, "70b": LLAMA33_70B, "q4": Q4_70B, "smollm2": SMOLLM2, "short": 16, "long": 64,
            "svd_tokens": 1024, "budget": "8GiB",
            "budgets": ["8GiB", "12GiB", "16GiB", "24GiB", "32GiB", "48GiB", "60GiB"], "svd_budget": "60GiB",
            "matmul": 8192, "exact_tokens": 12, "reference_lengths": [16, 64],
            "graph": {"tokens": 8, "max_nodes": 64, "heads": 8}}


def stamp() -> str:
    return datetime.now(UTC).strftime("%H:%M:%S")


def say(msg: str) -> None:
    print(f"[{stamp()}] {msg}", flush=True)


class Partial:
    """The step's results so far, rewritten to ``path`` at each :meth:`put` (the parent reads it if cut short)."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {}

    def put(self, **values: Any) -> None:
        self.data.update(values)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


class Meter:
    """Synchronized clocks and peak memory on a CUDA device (allocator peaks; the driver's use sampled at each
    :meth:`sample`), or on the CPU the process's peak RSS."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch, self.device = torch, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.driver_peak = 0

    def now(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def reset(self) -> None:
        from detjac.machine import reset_peak

        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats(self.device)
        reset_peak()  # the peak resident set starts again from the current one: steps share the worker process
        self.driver_peak = 0
        self.sample()

    def sample(self) -> None:
        if self.cuda:
            free, total = self.torch.cuda.mem_get_info(self.device)
            self.driver_peak = max(self.driver_peak, total - free)

    def peaks(self) -> dict[str, float]:
        from detjac.machine import peak_mib

        out = {"host_rss_peak_gib": peak_mib() / 1024}
        if self.cuda:
            self.sample()
            out.update(gpu_allocated_peak_gib=self.torch.cuda.max_memory_allocated(self.device) / 2**30,
                       gpu_reserved_peak_gib=self.torch.cuda.max_memory_reserved(self.device) / 2**30,
                       gpu_driver_used_peak_gib=self.driver_peak / 2**30)
        return out


def random_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    import torch

    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def checkpoint(args: argparse.Namespace, which: str) -> Path:
    """The random checkpoint of ``which`` under ``--tmp``, written once and reused (a marker beside it, written
    last, holds its config): "8b" and "70b" in bf16 with the default model's tokenizer copied in (so ``detjac run``
    can read text), "smollm2" in bf16 without a tokenizer (its graph names tokens by id), "q4" a GGUF file of Q4_0
    blocks."""
    import torch

    from .random_weights import write_random_checkpoint, write_random_gguf

    cfg = sizes(args.dry_run)[which]
    name = f"{which}{'-dry' if args.dry_run else ''}"
    path = Path(args.tmp) / (f"{name}.gguf" if which == "q4" else name)
    marker = Path(args.tmp) / f"{name}.gpu_check.json"
    if marker.is_file() and json.loads(marker.read_text()) == cfg and path.exists():
        return path
    marker.unlink(missing_ok=True)
    free = shutil.disk_usage(Path(args.tmp)).free
    say(f"writing the {which} checkpoint ({cfg['num_hidden_layers']} layers, {'Q4_0' if which == 'q4' else 'bf16'}) "
        f"to {path}; {free / 2**30:.0f} GiB free")
    t0 = time.perf_counter()
    if which == "q4":
        partial = path.with_suffix(".partial")
        total = write_random_gguf(partial, cfg, "Q4_0")
        partial.rename(path)
    else:
        shutil.rmtree(path, ignore_errors=True)
        total = write_random_checkpoint(path, cfg, torch.bfloat16)
        if which != "smollm2":
            _copy_default_tokenizer(path)
    marker.write_text(json.dumps(cfg))
    say(f"{which} checkpoint: {total / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s")
    return path


def _copy_default_tokenizer(folder: Path) -> None:
    from detjac.engine import ModelRef

    default = ModelRef.resolve("default").source
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default / name).is_file():
            shutil.copy(default / name, folder / name)


def dry_budget(folder: Path, dtype: Any, tokens: int) -> str:
    """The dry run's CPU budget: what leaves room for about half the rows, so that the J takes two row blocks (as
    the real shapes do under 8 GiB)."""
    from detjac.engine import StreamedEngine

    cost = StreamedEngine(folder, dtype=dtype, max_memory="cpu=1GiB").cost
    rows = cost.d_model // 2 + 1
    return f"{cost.weights_bytes + cost.block_bytes(tokens, 0) + rows * cost.vector_bytes(tokens)}B"


def device_budget(device: str, amount: str) -> str:
    return f"cpu={amount}" if device == "cpu" else f"{device}={amount}"  # the issue's --max-memory cuda:0=8GiB

