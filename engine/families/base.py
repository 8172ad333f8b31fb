"""What a family adapter must declare so detjac can linearize a model of that family.

A family is data, not code: its module classes by role and flags for what sets it apart, which
:mod:`detjac.engine.detach.model` wraps and :mod:`detjac.engine.detach.check` proves linear. Details: docs/engine.md,
"Families"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass(frozen=True)
class NormRule:
    """How one norm class computes (RMSNorm, or LayerNorm with ``center``).

    Parameters
    ----------
    cls
        The norm's module class.
    eps_attr
        Attribute that holds epsilon (``variance_epsilon`` for most, ``eps`` for Gemma3).
    weight_offset
        Output is ``norm(x) * (weight_offset + weight)``: 0 for Llama-style norms,
        1 for Gemma3's zero-initialised ``1 + w`` norms.
    center
        LayerNorm: subtract the mean first (a linear map, so it stays on the path) and
        add the norm's bias, if it has one, after the weight.
    """

    cls: type[nn.Module]
    eps_attr: str = "variance_epsilon"
    weight_offset: float = 0.0
    center: bool = False


@dataclass(frozen=True)
class MlpRule:
    """How one gated MLP class computes ``down(act(gate(x)) * up(x))``.

    With ``fused`` set, ``gate_up`` names one projection whose output is chunked into
    ``(gate, up)`` (Phi3); otherwise ``gate`` and ``up`` name two projections.
    """

    cls: type[nn.Module]
    act: str = "act_fn"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    fused: bool = False
    gate_up: str = "gate_up_proj"


@dataclass(frozen=True)
class MoeRule:
    """How one sparse mixture-of-experts block computes (see :mod:`detjac.engine.detach.moe`).

    ``router`` names the child that returns ``(router_logits, routing_weights,
    selected_experts)`` and ``experts`` the child that holds the experts' fused
    ``gate_up_proj`` (experts, 2 * ffn, d) and ``down_proj`` (experts, d, ffn) tensors
    and their ``act_fn``.
    """

    cls: type[nn.Module]
    router: str = "gate"
    experts: str = "experts"


@dataclass(frozen=True)
class Family:
    """Declaration of one model family's detach rules.

    Parameters
    ----------
    name
        Human-readable family name used in messages and metadata.
    model_types
        ``config.model_type`` values served by this adapter.
    norms, mlps
        Rules for the family's norm and gated-MLP classes (see :class:`NormRule`,
        :class:`MlpRule`).
    attentions
        Attention block classes. Their forward projects Q, K, V, applies the position
        encoding and calls the registered attention function, which freezes the
        probabilities; so only the value path stays.
    attention_frozen_children
        Children of an attention block that feed only Q and K (projections, QK norms).
        They sit behind the frozen softmax and are not checked.
    containers
        Structural classes whose forward only composes their children with residual
        adds (the base model, the decoder layer).
    position_modules
        Modules that depend on positions only, never on the input (rotary embeddings).
    decoder
        Returns the base decoder (the module that takes ``inputs_embeds`` and returns
        the final normed hidden states) of a loaded model.
    post_norm
        Post-norm layers (BERT): each sublayer's residual sum goes through a norm,
        ``mid = N1(h + A(h))``, ``out = N2(mid + M(mid))``, inside the sublayers' output modules.
    layers
        Returns the decoder's layers (a ``ModuleList``) from the decoder: ``decoder.layers`` unless declared.
    mid_residual
        Child of a decoder layer whose first input is the residual stream after the
        attention block and before the MLP block (the layer-streamed engine reads it to
        split a layer's output into its attention and MLP contributions).
    affine
        The family has biases on the path (biased ``nn.Linear``, GPT-2's ``Conv1D``,
        LayerNorm biases, learned position embeddings): with the factors frozen the map is
        affine, ``y = sum_k J_k x_k + b``, and the engine computes ``b``. The guard accepts
        biases only in such families.
    offset_children
        Children that add an input-independent offset to the input embeddings (learned
        absolute position embeddings, BERT's token-type embeddings). The Jacobian is taken
        with respect to the token embeddings only, so these offsets are part of ``b``.
    off_path_children
        Children that do not feed the target (BERT's pooler reads the final hidden states
        but nothing reads it back); the guard does not walk them.
    encoder
        Bidirectional encoder (BERT): loaded with ``AutoModel``, no language-model head;
        the default target is position 0 ([CLS]) and "logits" are scores against the word
        embeddings.
    config_problem
        Returns why a config cannot be linearized (a setting that adds a nonlinearity no
        module exposes, e.g. OLMoE's ``clip_qkv``), or None.
    streamable
        The layer-streamed engine supports the family (it does not support affine or
        mixture-of-experts families, and refuses them).
    conventions
        The detach conventions of its gated MLPs, the default first. The detached Jacobian is
        not unique: ``up`` freezes ``act(gate(x))`` and keeps the linear path through ``up``;
        ``gate`` (Phi3, the paper's reference implementation) freezes ``up(x)`` and the ratio
        ``act(g) / g`` (``sigmoid(g)`` for SiLU) and keeps the linear path through ``gate``.
        Both reconstruct exactly; their Jacobians differ.
    """

    name: str
    model_types: tuple[str, ...]
    norms: tuple[NormRule, ...]
    mlps: tuple[MlpRule, ...]
    attentions: tuple[type[nn.Module], ...]
    containers: tuple[type[nn.Module], ...]
    position_modules: tuple[type[nn.Module], ...]
    attention_frozen_children: frozenset[str] = field(
        default_factory=lambda: frozenset({"q_proj", "k_proj", "q_norm", "k_norm"})
    )
    decoder: Callable[[nn.Module], nn.Module] = field(default=lambda model: model.model)
    mid_residual: str = "post_attention_layernorm"
    layers: Callable[[nn.Module], nn.Module] = field(default=lambda decoder: decoder.layers)
    post_norm: bool = False
    moes: tuple[MoeRule, ...] = ()
    affine: bool = False
    offset_children: frozenset[str] = frozenset()
    off_path_children: frozenset[str] = frozenset()
    encoder: bool = False
    config_problem: Callable[[Any], str | None] = field(default=lambda config: None)
    streamable: bool = True
    conventions: tuple[str, ...] = ("up",)

    def check_convention(self, convention: str | None) -> str:
        """The detach convention to use: ``convention`` (None: the family's default, the first of
        :attr:`conventions`), refused with the valid choices when the family does not have it.

        Raises
        ------
        InvalidArgumentError
            A convention this family does not declare.
        """
        from detjac.errors import InvalidArgumentError

        if convention is None:
            return self.conventions[0]
        if convention not in self.conventions:
            raise InvalidArgumentError(
                f"Expected a detach convention of the {self.name} family among {', '.join(self.conventions)}. "
                f"Got {convention!r}."
            )
        return convention

    @property
    def default_position(self) -> int:
        """Target position when none is given: the last token (causal), or [CLS] at 0 (encoder)."""
        return 0 if self.encoder else -1

    def norm_rule(self, module: nn.Module) -> NormRule | None:
        """The rule for ``module`` if it is one of this family's norms."""
        return next((r for r in self.norms if type(module) is r.cls), None)

    def mlp_rule(self, module: nn.Module) -> MlpRule | None:
        """The rule for ``module`` if it is one of this family's gated MLPs."""
        return next((r for r in self.mlps if type(module) is r.cls), None)

    def moe_rule(self, module: nn.Module) -> MoeRule | None:
        """The rule for ``module`` if it is one of this family's mixture-of-experts blocks."""
        return next((r for r in self.moes if type(module) is r.cls), None)

    def describe(self, convention: str | None = None) -> list[str]:
        """One line per detach rule under ``convention`` (default: the family's), for metadata and listings."""
        lines = [
            f"{r.cls.__name__}: " + ("mean subtracted (linear), " if r.center else "")
            + f"variance scale frozen, output norm(x) * ({r.weight_offset:g} + w)" + (" + b" if r.center else "")
            for r in self.norms
        ]
        frozen = ("act(gate(x)) frozen" if self.check_convention(convention) == "up"
                  else "up(x) and act(g)/g of g = gate(x) frozen, linear path through gate (convention gate)")
        lines += [f"{r.cls.__name__}: {frozen}" + (f" ({r.gate_up} chunked into gate, up)" if r.fused else "")
                  for r in self.mlps]
        lines += [f"{r.cls.__name__}: router choice and weights frozen, each chosen expert's act(gate(x)) frozen"
                  for r in self.moes]
        lines += [f"{c.__name__}: softmax(QK^T/sqrt(d) + mask) frozen" for c in self.attentions]
        if self.affine:
            lines.append("ungated activations x * s(x): s frozen; biases and position embeddings: the offset b")
        return lines
