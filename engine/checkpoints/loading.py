"""Load checkpoints and turn prompts into token ids, with errors a user can act on.

Loading never executes pickled code: ``trust_remote_code`` is off unless the caller asks,
safetensors are preferred, and transformers loads any ``.bin`` with ``weights_only``.
"""

from __future__ import annotations

import pickle
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from detjac.errors import CheckpointError, PromptError
from detjac.safe_json import parse_json

from ..families import family_for
from .quiet import quiet_tokenizer
from .reference import ModelRef
from .weights import SafetensorsWeights, check_shapes, safetensors_shapes, tensors_error

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")

# Tokenizers of models loaded through load_model, without attaching attributes to them.
_TOKENIZERS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def check_checkpoint_dir(path: ModelRef | str | Path, revision: str | None = None) -> Path:
    """Return the checkpoint directory ``path`` names, else raise: ``path`` itself, or the Hugging Face cache's
    snapshot folder of a hub id (``org/name``, at ``revision``; see :mod:`detjac.engine.checkpoints.hub`).

    Raises
    ------
    CheckpointError
        The path is missing, not a directory, or lacks ``config.json`` or weights; a hub id
        that is not in the cache and cannot be downloaded.
    """
    return read_checkpoint(path, revision)[0]


def read_checkpoint(model: ModelRef | str | Path, revision: str | None = None) -> tuple[Path, dict[str, Any]]:
    """The checked checkpoint directory and its parsed config.json (see :func:`check_checkpoint_dir`); for a GGUF
    file, the file and the config transformers reads from it (see :mod:`detjac.engine.checkpoints.gguf`).
    ``model`` is a :class:`ModelRef`; a string or path (``"default"`` names the shipped model, as on the command line)
    is resolved first, once (:meth:`ModelRef.of`)."""
    ref = ModelRef.of(model, revision)
    if ref.is_gguf:
        from .gguf import gguf_config, gguf_path

        file = gguf_path(ref.source)
        return file, gguf_config(file).to_dict()
    p = ref.source
    path = ref.name if ref.kind == "folder" else str(p)  # as the user wrote it, or where it was found
    if not (p / "config.json").is_file():
        raise CheckpointError(
            f"Expected a Hugging Face checkpoint directory containing config.json. Got "
            f"{str(path)!r}, which has no config.json, so it is not a checkpoint."
        )
    try:
        config = parse_json((p / "config.json").read_bytes())  # deep nesting, huge numbers: one line
    except (OSError, ValueError) as e:
        raise CheckpointError(f"Expected a readable JSON config.json in {str(path)!r}. Got: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(
            f"Expected config.json in {str(path)!r} to hold a JSON object. Got a {type(config).__name__}."
        )
    if not any((p / f).is_file() for f in _WEIGHT_FILES):
        raise CheckpointError(
            f"Expected weights ({' or '.join(_WEIGHT_FILES[::2])}) in {str(path)!r}. Got a "
            "config.json without weights."
        )
    # Refuse an unsupported family from config.json alone, before any weights header is read or transformers parses
    # it (a model_type transformers does not know would otherwise fail with its own message).
    family_for(SimpleNamespace(model_type=config.get("model_type")))
    check_config_sizes(p, config, safetensors_shapes(p))
    return p, config


# Sizes a config gives the model: each must be a positive integer, a layer count at most the number of tensors in
# the checkpoint (every layer has weights) and any other size at most the largest dimension of its tensors; where
# the weights are not safetensors (their headers unreadable without unpickling), at most these bounds.
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_SIZE_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "n_embd", "n_head", "n_inner", "num_experts",
              "num_local_experts", "num_experts_per_tok")
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "sliding_window")
_BOUNDS = {"layers": 2**12, "size": 2**22, "positions": 2**24}


def check_config_sizes(path: Path, config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse a config.json (its text part included) whose sizes are not positive integers or ask for more than the
    checkpoint's tensors hold, before transformers parses it or anything is allocated (see ``_BOUNDS``)."""
    largest = max((n for shape in shapes.values() for n in shape), default=_BOUNDS["size"])
    limits = [(_LAYER_KEYS, len(shapes) or _BOUNDS["layers"],
               f"the number of tensors in its weights, {len(shapes)}" if shapes else str(_BOUNDS["layers"])),
              (_SIZE_KEYS, largest, f"the largest dimension of its tensors, {largest}" if shapes else str(largest)),
              (_POSITION_KEYS, _BOUNDS["positions"], str(_BOUNDS["positions"]))]
    for part, where in ((config, ""), (config.get("text_config"), " (text_config)")):
        if not isinstance(part, dict):
            continue
        for keys, bound, said in limits:
            for key in keys:
                value = part.get(key)
                if value is None:
                    continue
                if type(value) is not int or value < 1:
                    raise CheckpointError(f"Expected {key} in {path / 'config.json'}{where} to be a positive integer. "
                                          f"Got {value!r} ({type(value).__name__}).")
                if value > bound:
                    raise CheckpointError(f"Expected {key} in {path / 'config.json'}{where} to be at most {said}. "
                                          f"Got {value}: a damaged or mistaken config.")


def load_model(
    source: ModelRef | str | Path | nn.Module,
    *,
    dtype: torch.dtype | None = torch.float64,
    device: str | torch.device = "cpu",
    revision: str | None = None,
    trust_remote_code: bool = False,
    tokenizer: Any | None = None,
) -> PreTrainedModel:
    """Load a causal LM (or, for an encoder family such as BERT, the base model) of a supported family,
    or accept one already loaded.

    Parameters
    ----------
    source
        A :class:`ModelRef` (a string or path is resolved into one, once); it names a local checkpoint directory, a
        GGUF file (its weights dequantized into a plain model, see
        :mod:`detjac.engine.checkpoints.gguf`), a Hugging Face hub id (``org/name``: the cache's snapshot, see
        :mod:`detjac.engine.checkpoints.hub`), or an already-loaded ``PreTrainedModel``.
    dtype
        Parameter dtype: a torch dtype or its name (``"float32"``). float64 (the default) is the exactness mode;
        ``None`` keeps the checkpoint's (or the given model's) dtype (float32 for a GGUF).
    device
        Device to place the model on.
    revision, trust_remote_code
        Passed to ``from_pretrained``. Remote code stays off unless asked for.
    tokenizer
        A tokenizer to remember for this model; by default the checkpoint's own.

    Returns
    -------
    The model in eval mode. Its tokenizer is remembered (see :func:`get_tokenizer`).

    Raises
    ------
    CheckpointError
        ``source`` is not a checkpoint directory.
    UnsupportedModelError
        The model's family has no detach rules.
    """
    from ..memory import check_device, compute_dtype

    device = check_device(device)  # before anything loads: one line naming the devices this PyTorch has
    dtype = None if dtype is None else compute_dtype(dtype)  # "float32" as well as torch.float32, for every source
    ref = None if isinstance(source, nn.Module) else ModelRef.of(source, revision)
    if isinstance(source, nn.Module):
        model = source
        family_for(model.config)
        if dtype is not None:
            model.to(dtype=dtype)
        model.to(device)
    elif ref is not None and ref.is_gguf:
        from .gguf import gguf_tokenizer, load_gguf_model

        model = load_gguf_model(ref.source, dtype=dtype or torch.float32, device=device)
        if tokenizer is None:
            tokenizer = gguf_tokenizer(ref.source)
    else:
        from transformers import AutoModel, AutoModelForCausalLM

        path, raw_config = read_checkpoint(ref, revision)  # refuses an unsupported family first
        config = parse_config(path, revision, trust_remote_code)
        family = family_for(config)  # remote code may declare its own model_type: check the parsed config too
        auto = AutoModel if family.encoder else AutoModelForCausalLM  # an encoder has no causal LM head
        # MoE experts: the stock default (grouped_mm) rejects float64; eager is the loop detjac mirrors
        extra = {"experts_implementation": "eager"} if family.moes else {}
        if tokenizer is None:  # before the weights: a broken tokenizer costs no load
            tokenizer = load_tokenizer(path, revision, trust_remote_code)
        if _has_safetensors(path) and not trust_remote_code:  # shapes against the config, nothing allocated
            with torch.device("meta"):
                skeleton = auto.from_config(config, **extra)
            check_shapes(skeleton, SafetensorsWeights(path, raw_config), f"a checkpoint in {path}")
        try:
            with _quiet_transformers():  # its "Loading weights" bar, on every load, says nothing a user can act on
                model, info = auto.from_pretrained(
                    path, config=config, revision=revision, dtype=dtype or "auto", output_loading_info=True,
                    trust_remote_code=trust_remote_code, use_safetensors=_has_safetensors(path), **extra,
                )
        except pickle.UnpicklingError as exc:  # a .bin with objects weights_only refuses: never executed
            raise CheckpointError(f"Expected weights that torch.load(weights_only=True) reads in {path}. Got a pickled "
                                  f"file that holds other objects ({_refused_object(exc)}); it was not loaded."
                                  ) from None
        _check_loading_info(path, info)
        model.to(device)
    model.eval()
    if tokenizer is not None:
        _TOKENIZERS[model] = quiet_tokenizer(tokenizer)
    return model


def parse_config(path: Path, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """transformers' config of a checkpoint folder; CheckpointError (one line) for one it refuses."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, KeyError, OSError) as exc:  # huggingface_hub's validation errors are ValueErrors
        raise CheckpointError(f"Expected a config.json transformers accepts in {path}. Got: "
                              f"{' '.join(str(exc).split())}") from None


def load_tokenizer(path: Path, revision: str | None = None, trust_remote_code: bool = False) -> Any | None:
    """The tokenizer of a checkpoint folder (None when it has no tokenizer files); CheckpointError naming the folder
    for one that cannot be read (damaged JSON, a file of another tokenizer)."""
    if not any(path.glob("tokenizer*")):
        return None
    from transformers import AutoTokenizer

    try:
        return quiet_tokenizer(AutoTokenizer.from_pretrained(path, revision=revision,
                                                             trust_remote_code=trust_remote_code))
    except Exception as exc:  # noqa: BLE001 - tokenizers raise their own types (Exception, ValueError, ...)
        raise CheckpointError(f"Expected a readable tokenizer in {path} (tokenizer.json, tokenizer_config.json, "
                              f"...). Got {type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None


def _refused_object(exc: Exception) -> str:
    """What ``torch.load(weights_only=True)`` refused, from its message ("... unsupported GLOBAL posix.getcwd ...")."""
    lines = [line.strip() for line in str(exc).splitlines() if "nsupported" in line or "GLOBAL" in line]
    return (lines[0] if lines else type(exc).__name__)[:200]


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars off for the duration of the block (then as they were)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _check_loading_info(path: Path, info: dict[str, Any]) -> None:
    """Refuse what transformers would only warn about: a parameter missing from the checkpoint (initialized
    at random) or a tensor the model has no place for (a checkpoint of another architecture)."""
    found = {what: [str(k) for k in info.get(f"{what}_keys") or ()] for what in ("missing", "unexpected", "mismatched")}
    if any(found.values()):
        raise tensors_error(f"a checkpoint in {path}", found)


def _has_safetensors(path: Path) -> bool | None:
    return True if any(path.glob("*.safetensors*")) else None


def get_tokenizer(model: PreTrainedModel) -> Any | None:
    """The tokenizer remembered for ``model``, else the one in its checkpoint dir, else None."""
    if model in _TOKENIZERS:
        return _TOKENIZERS[model]
    name = getattr(model.config, "_name_or_path", "")
    if name and (Path(name) / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tok = quiet_tokenizer(AutoTokenizer.from_pretrained(name))
        _TOKENIZERS[model] = tok
        return tok
    return None


def parse_prompt(prompt: str | Sequence[int] | torch.Tensor, model: PreTrainedModel,
                 tokenizer: Any | None = None) -> list[int]:
    """Token ids for ``prompt`` (text, or ids given directly), checked against the model.

    Raises
    ------
    PromptError
        Empty prompt, text without a tokenizer, ids out of the vocabulary, or more
        tokens than the model's context.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError(
                f"Expected a prompt of at least one token. Got {'an empty' if not prompt else 'a whitespace-only'} "
                "string instead."
            )
        tokenizer = tokenizer if tokenizer is not None else get_tokenizer(model)
        if tokenizer is None:
            raise PromptError(
                "Expected a tokenizer to turn the text prompt into tokens. Got a model without one: "
                "load it with detjac.engine.load_model(checkpoint_dir), pass tokenizer=..., or give token ids."
            )
        ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    else:
        ids = [int(i) for i in (prompt.reshape(-1).tolist() if isinstance(prompt, torch.Tensor) else prompt)]
    if not ids:
        raise PromptError("Expected a prompt of at least one token. Got no tokens instead.")
    vocab = model.get_input_embeddings().num_embeddings
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise PromptError(f"Expected token ids in [0, {vocab}). Got {bad[:5]} instead.")
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and len(ids) > limit:
        raise PromptError(
            f"Expected a prompt of at most {limit} tokens (the model's max_position_embeddings). "
            f"Got {len(ids)} tokens instead."
        )
    return ids
