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

from .tiny import tiny_config

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
