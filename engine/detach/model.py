"""Linearize a loaded model in place, for the duration of a ``with`` block.

:func:`linearized` wraps the model's own instances (:mod:`detjac.engine.detach.wrappers`), runs the guard and restores
everything on exit; nothing at module level or under site-packages is changed. Details: docs/engine.md, "Linearizing
a loaded model"."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from detjac.errors import UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from ..families import Family, family_for
from .activations import activation_ratio
from .check import check_linear_path
from .moe import DetachedMoE
from .wrappers import (
    DETACHED_ATTENTION,
    EXACT_ATTENTION,
    DetachedActivation,
    DetachedGatedMLP,
    DetachedInput,
    DetachedNorm,
    register_attention,
)


@dataclass(frozen=True)
class Linearized:
    """What :func:`linearized` yields: the model, its decoder and its family."""

    model: PreTrainedModel
    decoder: nn.Module
    family: Family
    detach: bool
    convention: str = "up"


def _wrapper_for(module: nn.Module, family: Family, detach: bool, convention: str) -> nn.Module | None:
    """The detached wrapper of ``module`` if a rule covers it."""
    if (norm := family.norm_rule(module)) is not None:
        return DetachedNorm(module, norm, detach)
    if (mlp := family.mlp_rule(module)) is not None:
        return DetachedGatedMLP(module, mlp, detach, convention)
    if (moe := family.moe_rule(module)) is not None:
        return DetachedMoE(module, moe, detach)
    if (ratio := activation_ratio(module)) is not None:
        return DetachedActivation(module, ratio, detach)
    return None


def _wrap_instances(decoder: nn.Module, family: Family, detach: bool,
                    convention: str) -> list[tuple[nn.Module, str, nn.Module]]:
    """Replace norm, MLP, MoE and activation instances under ``decoder``; return (parent, name, original) to undo.

    A wrapped module is not descended into: the activation inside a gated MLP is already
    part of its frozen branch.
    """
    replaced: list[tuple[nn.Module, str, nn.Module]] = []

    def visit(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            wrapper = _wrapper_for(child, family, detach, convention)
            if wrapper is None and detach and type(parent) in family.attentions \
                    and name in family.attention_frozen_children:  # a query or key projection
                wrapper = DetachedInput(child, detach)
            if wrapper is None:
                visit(child)
            else:
                setattr(parent, name, wrapper)
                replaced.append((parent, name, child))

    visit(decoder)
    return replaced


@contextmanager
def linearized(model: PreTrainedModel, *, detach: bool = True, convention: str | None = None) -> Iterator[Linearized]:
    """Run a block with ``model`` linearized (``detach=True``) or exact but not detached.

    Parameters
    ----------
    model
        A loaded Hugging Face causal LM of a supported family.
    detach
        Freeze the nonlinear factors (the detached Jacobian). With ``False`` the same
        exact-dtype computation runs without freezing (the ordinary Jacobian).
    convention
        The family's detach convention (:attr:`~detjac.engine.families.Family.conventions`);
        None: its default.

    Raises
    ------
    UnsupportedModelError
        Unknown ``model_type``, or a module on the input-to-output path without a rule.
    InvalidArgumentError
        A convention the family does not have.
    """
    family = family_for(model.config)
    convention = family.check_convention(convention)
    problem = family.config_problem(model.config.get_text_config())
    if problem is not None:
        raise UnsupportedModelError(f"Expected a {family.name} config without extra nonlinearities. Got {problem}.")
    decoder = family.decoder(model)
    register_attention()
    was_training = model.training
    grad_flags = [(p, p.requires_grad) for p in model.parameters()]
    configs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    attn_before = [(c, c._attn_implementation) for c in {id(c): c for c in configs}.values()]
    replaced: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        replaced = _wrap_instances(decoder, family, detach, convention)
        for config, _ in attn_before:
            config._attn_implementation = DETACHED_ATTENTION if detach else EXACT_ATTENTION
        model.eval()
        model.requires_grad_(False)
        check_linear_path(decoder, family, prefix=_path_of(model, decoder))
        yield Linearized(model=model, decoder=decoder, family=family, detach=detach, convention=convention)
    finally:
        for parent, name, original in reversed(replaced):
            setattr(parent, name, original)
        for config, impl in attn_before:
            config._attn_implementation = impl
        for p, flag in grad_flags:
            p.requires_grad_(flag)
        model.train(was_training)


def _path_of(model: PreTrainedModel, sub: nn.Module) -> str:
    """Dotted name of ``sub`` inside ``model`` (for messages), or its class name."""
    return next((n for n, m in model.named_modules() if m is sub and n), type(sub).__name__)
