"""The guard: prove that every module on the input-to-output path is linear once frozen.

:func:`check_linear_path` walks the path from the decoder down and accepts only what it can prove linear; anything
else raises :class:`UnsupportedModelError` naming the module's path and class. What is accepted: docs/engine.md,
"The guard"."""

from __future__ import annotations

from torch import nn
from transformers.pytorch_utils import Conv1D

from detjac.errors import UnsupportedModelError

from ..families import Family
from .activations import supported_activations
from .moe import DetachedMoE
from .wrappers import DetachedGatedMLP, DetachedModule

_GENERIC_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def check_linear_path(decoder: nn.Module, family: Family, prefix: str = "model") -> None:
    """Raise :class:`UnsupportedModelError` unless ``decoder`` is linear given frozen factors."""
    get_embeddings = getattr(decoder, "get_input_embeddings", None)
    skip = {id(get_embeddings())} if get_embeddings is not None else set()
    _visit(decoder, prefix, family, skip)


def _children(module: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    return [(f"{path}.{name}", child) for name, child in module.named_children()]


def _refuse_bias(module: nn.Module, path: str, family: Family) -> None:
    if not family.affine:
        raise UnsupportedModelError(
            f"Expected bias-free linear layers on the path from the input embeddings to the "
            f"output. Got a biased {type(module).__name__} at {path}: the detached map would be affine "
            f"(y = sum_k J_k x_k + b), which the {family.name} adapter does not declare (Family.affine)."
        )


def _visit(module: nn.Module, path: str, family: Family, skip: set[int]) -> None:
    if id(module) in skip:
        return
    cls = type(module).__name__
    name = path.rsplit(".", 1)[-1]
    if isinstance(module, (DetachedGatedMLP, DetachedMoE)):
        children = [(f"{path}.{n}", m) for n, m in module.linear_modules()]
    elif isinstance(module, DetachedModule):
        children = []  # a norm or activation wrapper: computes from its inner weights directly
    elif type(module) is nn.Linear:  # subclasses (quantized layers) need their own rule
        if module.bias is not None:
            _refuse_bias(module, path, family)
        children = []
    elif type(module) is Conv1D:  # GPT-2's transposed linear layer, always biased
        _refuse_bias(module, path, family)
        children = []
    elif type(module) is nn.Embedding and name in family.offset_children:
        if not family.affine:
            raise UnsupportedModelError(f"Expected no learned offset on the path. Got {cls} at {path}, which the "
                                        f"{family.name} adapter does not declare affine.")
        children = []
    elif name in family.off_path_children:
        children = []
    elif type(module) in family.attentions:
        children = [
            (p, m) for p, m in _children(module, path)
            if p.rsplit(".", 1)[-1] not in family.attention_frozen_children
        ]
    elif type(module) in family.containers or type(module) in _GENERIC_CONTAINERS:
        children = _children(module, path)
    elif type(module) in family.position_modules or type(module) is nn.Dropout:
        children = []
    else:
        raise UnsupportedModelError(
            f"Expected every module on the path from the input embeddings to the output to "
            f"have a detach rule. Got {cls} at {path}, which the {family.name} adapter does not "
            f"know (module class {type(module).__module__}.{cls}). Ungated activations with a rule: "
            f"{', '.join(supported_activations())}. Add a rule for it under "
            f"engine/families/ before trusting a Jacobian of this model."
        )
    for child_path, child in children:
        _visit(child, child_path, family, skip)
