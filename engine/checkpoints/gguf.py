"""GGUF checkpoints (llama.cpp's one-file format) as a model source: config, tokenizer and weights.

The façade of the GGUF modules: :mod:`.gguf_header` (:func:`read_gguf_header` checks a file before anything is loaded),
:mod:`.gguf_names` (the header's claims against the tensor table; parameter names), :mod:`.gguf_dequant`
(:class:`GGUFWeights` reads and dequantizes one tensor or row at a time) and :mod:`.gguf_tokenizer`. Exact for the
weights as dequantized, not for the model the file was quantized from. Details and scope of exactness:
docs/engine.md, "GGUF files"."""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from detjac.errors import CheckpointError, UnsupportedModelError
from detjac.model_names import is_gguf, looks_like_gguf

from .gguf_dequant import GGUFWeights
from .gguf_header import GGUFHeader, GGUFTensor, _read_header, _stat, read_gguf_header
from .gguf_names import check_claims
from .gguf_tokenizer import check_tokenizer, gguf_tokenizer
from .reference import ModelRef, gguf_in, gguf_path

__all__ = ["GGUFHeader", "GGUFTensor", "GGUFWeights", "gguf_config", "gguf_in", "gguf_path", "gguf_tokenizer",
           "is_gguf", "load_gguf_model", "looks_like_gguf", "read_gguf_header", "select_gguf"]


def select_gguf(source: str | Path, gguf_file: str, revision: str | None = None) -> Path:
    """The GGUF file ``gguf_file`` inside the folder ``source``, or in the hub repository ``source`` (``org/name``:
    from the Hugging Face cache, else downloaded when online; see :mod:`detjac.engine.checkpoints.hub`): MODEL with
    ``--gguf-file``, resolved as every MODEL is (:meth:`~detjac.engine.ModelRef.resolve`).

    Raises
    ------
    CheckpointError
        No such file (the folder's GGUF files are named), or a hub file not in the cache while offline.
    """
    return ModelRef.resolve(source, gguf_file, revision).source


def gguf_config(path: Path) -> Any:
    """The transformers config of a GGUF file (transformers' own GGUF config mapping), with its family checked.

    Raises
    ------
    CheckpointError
        A damaged file (see :func:`read_gguf_header`).
    UnsupportedModelError
        An architecture transformers cannot read from GGUF, or one detjac has no family for.
    """
    return copy.deepcopy(_config(path, *_stat(path)))


@lru_cache(maxsize=8)
def _config(path: Path, size: int, mtime_ns: int) -> Any:
    from transformers import AutoConfig

    from ..families import family_for

    header = _read_header(path, size, mtime_ns)
    if _has_family(header.architecture):  # else refused below, naming the architecture
        check_claims(header)
        check_tokenizer(header)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise UnsupportedModelError(f"Expected a GGUF of an architecture transformers can load. Got "
                                    f"{header.architecture!r} in {path}: {_first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - transformers' config validators raise their own types
        raise CheckpointError(f"Expected GGUF metadata transformers accepts as a config in {path}. Got "
                              f"{type(exc).__name__}: {_first_line(exc)}") from None
    family_for(config)
    return config


def _has_family(architecture: str) -> bool:
    """Whether a GGUF architecture name is a model type detjac has a family for (gemma3's is ``gemma3_text``)."""
    from ..families import FAMILIES

    return architecture in FAMILIES or f"{architecture}_text" in FAMILIES


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def load_gguf_model(source: str | Path, *, dtype: torch.dtype, device: str | torch.device = "cpu") -> nn.Module:
    """A plain transformers model of a GGUF file's architecture, its weights dequantized to ``dtype`` (tied
    embeddings tied), in eval mode. Never transformers' packed GGUF model, which computes in float32.

    Raises
    ------
    CheckpointError
        A damaged file, or one whose tensors are not exactly the model's.
    UnsupportedModelError
        An architecture without a detjac family.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from .weights import check_complete

    path = gguf_path(source)
    config = gguf_config(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    weights = GGUFWeights(path, model)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    head = model.get_output_embeddings()
    head_name = next((n + ".weight" for n, m in model.named_modules() if m is head), None)
    check_complete(model, weights, f"a GGUF file {path}", optional={head_name} if tied else ())
    state = {name: weights.read(name).to(dtype=dtype) for name in weights.names()}
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    model.to(device)
    model.config.name_or_path = str(path)
    return model.eval()


