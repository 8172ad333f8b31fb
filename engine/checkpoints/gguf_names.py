"""Which GGUF tensor is which model parameter, and whether the header's claims (layers, widths, heads) agree with
the tensor table: checked before a model is built for them, so a header cannot size what the file does not hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from detjac.errors import CheckpointError

from .gguf_header import GGUFHeader


@dataclass(frozen=True)
class _TopLevel:
    """A model as transformers' GGUF name map sees it, without its submodules: the whole state dict's names are at
    the top already, and the map's walk into every submodule (for checkpoints converted from a base model) took
    seconds."""

    model: nn.Module

    @property
    def config(self) -> Any:
        return self.model.config

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def named_children(self) -> list[tuple[str, nn.Module]]:
        return []




def model_tensor_names(model: nn.Module, header: GGUFHeader, processor: Any) -> dict[str, str]:
    """``{model parameter name: GGUF tensor name}`` for the tensors the file holds, by transformers' GGUF name map."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    to_model = get_gguf_hf_weights_map(_TopLevel(model), processor)
    return {hf: gg for gg, hf in to_model.items() if gg in header.tensors}


def _count(header: GGUFHeader, key: str, *, required: bool = True) -> int | None:
    """The metadata value ``key`` as a positive integer (CheckpointError naming the key and value otherwise)."""
    value = header.metadata.get(key)
    if value is None and not required:
        return None
    if type(value) is not int or value < 1:
        raise CheckpointError(f"Expected {key} to be a positive integer in the GGUF file {header.path}. Got "
                              f"{value!r}.")
    return value


def _layers(header: GGUFHeader) -> dict[int, dict[str, tuple[int, ...]]]:
    """``{layer: {tensor suffix: shape}}`` of the ``blk.<layer>.<suffix>`` tensors."""
    found: dict[int, dict[str, tuple[int, ...]]] = {}
    for name, tensor in header.tensors.items():
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            found.setdefault(int(parts[1]), {})[parts[2]] = tensor.shape
    return found


def check_claims(header: GGUFHeader) -> None:
    """Refuse a header whose claims (layers, width, heads, MLP width) the tensor table does not bear out, before a
    model is built for them: a header alone must never size an allocation.

    Raises
    ------
    CheckpointError
        Naming the metadata key, the value claimed and what the tensors hold.
    """
    arch, path = header.architecture, header.path
    n_layers = _count(header, f"{arch}.block_count")
    layers = _layers(header)
    if sorted(layers) != list(range(n_layers)):  # type: ignore[arg-type]
        held = f"blk.0 to blk.{max(layers)}" if layers else "none"
        raise CheckpointError(f"Expected tensors for the {n_layers} layers {arch}.block_count claims in {path}. Got "
                              f"tensors for {len(layers)} layers ({held}).")
    first = layers[0]
    for index, tensors in layers.items():
        if tensors != first:
            odd = sorted(set(tensors.items()) ^ set(first.items()))[0][0]
            raise CheckpointError(f"Expected layer {index} of {path} to hold the tensors of layer 0, shapes "
                                  f"included. Got a difference at blk.{index}.{odd}.")
    _check_widths(header, first)


def _check_widths(header: GGUFHeader, layer: dict[str, tuple[int, ...]]) -> None:
    """The width, head counts and MLP width claimed against the shapes of the embedding and of layer 0."""
    arch, path = header.architecture, header.path
    d = _count(header, f"{arch}.embedding_length")
    embd = header.tensors.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2 or embd.shape[1] != d:
        raise CheckpointError(f"Expected token_embd.weight of width {d} ({arch}.embedding_length) in {path}. Got "
                              f"{'none' if embd is None else f'shape {embd.shape}'}.")
    heads = _count(header, f"{arch}.attention.head_count", required=False)
    kv = _count(header, f"{arch}.attention.head_count_kv", required=False) or heads
    q, k = layer.get("attn_q.weight"), layer.get("attn_k.weight")
    if heads is not None and q is not None:
        if q[0] % heads or (k is not None and (k[0] % kv or k[0] // kv != q[0] // heads)):  # type: ignore[operator]
            raise CheckpointError(f"Expected {arch}.attention.head_count {heads} (and head_count_kv {kv}) to split "
                                  f"attn_q.weight {q} and attn_k.weight {k} into heads of one size in {path}. Got "
                                  "shapes that do not.")
    ff = header.metadata.get(f"{arch}.feed_forward_length")
    up = layer.get("ffn_up.weight")
    if isinstance(ff, int) and up is not None and up[0] != ff:
        raise CheckpointError(f"Expected ffn_up.weight with {ff} rows ({arch}.feed_forward_length) in {path}. Got "
                              f"shape {up}.")
