"""Interventions on a node: ablate (zero or mean) or clamp MLP neurons and attention heads at a position, and the new
next-token prediction twice, as the exact linear system predicts it and as the real model computes it.

A neuron is one input of its MLP's down projection (its value ``z``, as the attribution graphs number them); a head
at a position is its slice of the attention's output projection input (the head's output before ``o_proj``). An
:class:`Edit` replaces that value at one position: by zero, by its mean over the prompt's positions, or by a given
value. :func:`intervene` applies a group of edits at once and gives:

- ``linear``: the frozen system (every norm scale, gate and attention pattern frozen at the prompt's values, the
  system whose Jacobian is the detached Jacobian) run with the edits. It is affine in the edited values, so it is
  exactly the prompt's output plus the edits' change pulled through the detached Jacobian of their sites. The factors
  are recorded on the prompt and replayed (:class:`~detjac.engine.detach.factors.FactorTape`), never recomputed.
- ``real``: the unmodified model's own forward with the same edits (forward pre-hooks on the projections, removed on
  exit even on error).

Guarantees: both columns are computed at the prompt's last position, from the whole model in memory; the edits are
checked (layer, index, position, mode, value) before any forward runs. Not covered: encoders (no next token),
mixture-of-experts MLPs' neurons (experts have no single down projection here) and the layer-streamed engine.
Details: docs/graphs.md, "Interventions".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from detjac.errors import InvalidArgumentError, UnsupportedModelError
from detjac.tokens import token_labels

from ..detach.factors import FactorTape
from ..detach.model import linearized
from ..interface import Engine
from ..types import Prompt

KINDS = ("neuron", "head")
MODES = ("zero", "mean", "clamp")
# an ungated MLP's down projection, by the name its family gives it (GPT-2: c_proj)
_UNGATED_DOWN = ("down_proj", "c_proj", "fc2")


@dataclass(frozen=True)
class Edit:
    """One edit: the ``index``-th neuron or head (``kind``) of decoder layer ``layer`` at prompt position
    ``position``, set to zero, to its mean over the prompt's positions, or to ``value`` (``mode``).

    ``value`` is for ``clamp`` only: a number (a neuron's value; for a head, every one of its output's components)
    or, for a head, its whole output (``head_dim`` numbers)."""

    kind: str
    layer: int
    index: int
    position: int
    mode: str = "zero"
    value: float | Sequence[float] | None = None


@dataclass(frozen=True)
class Column:
    """A top-k prediction: token ids and texts, logits and probabilities (best first), and the target token's logit
    change from the unedited prediction of the same system (``target_change``)."""

    token_ids: list[int]
    tokens: list[str]
    logits: list[float]
    probabilities: list[float]
    target_logit: float
    target_change: float

    def to_dict(self) -> dict[str, Any]:
        return {"token_ids": self.token_ids, "tokens": self.tokens, "logits": self.logits,
                "probabilities": self.probabilities, "target_logit": self.target_logit,
                "target_change": self.target_change}


@dataclass(frozen=True)
class Intervention:
    """What :func:`intervene` gives: the edits, the target token, the unedited prediction (``before``, the real
    model's) and the two edited ones, side by side (``linear``: the frozen system's; ``real``: the model's), with
    their full logits (vocab,) for checks."""

    edits: tuple[Edit, ...]
    target: int
    target_token: str
    before: Column
    linear: Column
    real: Column
    logits: dict[str, torch.Tensor]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: the edits, the target and the three columns (no full logits)."""
        return {"edits": [vars(e) | {"value": _plain(e.value)} for e in self.edits], "target": self.target,
                "target_token": self.target_token, "before": self.before.to_dict(), "linear": self.linear.to_dict(),
                "real": self.real.to_dict()}


def _plain(value: Any) -> Any:
    return list(map(float, value)) if isinstance(value, Sequence) else value


@dataclass(frozen=True)
class _Unit:
    """Where an edit acts: the input of ``module`` at ``position``, columns ``cols`` (a slice of its last dim)."""

    module: nn.Module
    position: int
    cols: slice
    edit: Edit


def intervene(engine: Engine, prompt: Prompt, edits: Sequence[Edit], top_k: int = 10,
              target: int | None = None) -> Intervention:
    """The next-token prediction at the prompt's last position with ``edits`` applied together, twice: as the exact
    linear (frozen) system predicts it and as the real model computes it (see the module docstring).

    Parameters
    ----------
    engine
        An engine with the whole model in memory (:class:`~detjac.engine.InMemoryEngine`) of a causal family.
    prompt
        Text or token ids.
    edits
        At least one :class:`Edit`; applied at once.
    top_k
        Tokens per column.
    target
        The token id whose logit change each column reports; None: the unedited model's top token.

    Returns
    -------
    Intervention
        ``before``, ``linear`` and ``real`` columns of ``top_k`` tokens.

    Raises
    ------
    InvalidArgumentError
        No edit, an edit out of range (kind, layer, neuron or head, position, mode, value), a ``top_k`` or ``target``
        outside the vocabulary, or a layer-streamed engine; all before any forward pass.
    UnsupportedModelError
        An encoder, or a neuron edit in a mixture-of-experts MLP.
    PromptError
        An empty prompt, unknown ids, or more tokens than the model's context.
    """
    check_whole_model(engine, "interventions")
    ids = engine.token_ids(prompt)
    vocab = int(engine.model.get_output_embeddings().weight.shape[0])
    if not 1 <= int(top_k) <= vocab:
        raise InvalidArgumentError(f"Expected top_k in [1, {vocab}]. Got {top_k} instead.")
    if target is not None and not 0 <= int(target) < vocab:
        raise InvalidArgumentError(f"Expected a target token id in [0, {vocab}). Got {target} instead.")
    units = check_edits(engine, edits, len(ids))
    input_ids = torch.tensor([ids], device=engine.device)
    frozen_before, frozen_after, values = _frozen_pass(engine, input_ids, units)
    seen: list[torch.Tensor] = [torch.empty(0)] * len(units)
    with _recording(units, seen):  # the real model's own values: its means differ from the frozen ones in rounding
        before = engine.stock_logits(ids, -1)
    with _replacing(units, [_new_value(u, s) for u, s in zip(units, seen, strict=True)]):
        real = engine.stock_logits(ids, -1)
    target = int(before.argmax()) if target is None else int(target)
    columns = {name: _column(engine, logits, base, target, int(top_k)) for name, logits, base in (
        ("before", before, before), ("linear", frozen_after, frozen_before), ("real", real, before))}
    return Intervention(tuple(u.edit for u in units), target, token_labels(engine.tokenizer, [target])[0],
                        logits={"before": before, "frozen_before": frozen_before, "linear": frozen_after,
                                "real": real}, **columns)


def check_whole_model(engine: Engine, what: str) -> None:
    """Refuse (by name) an engine whose model is not whole in memory or has no next token to predict: the frozen
    system's own forward (``what`` needs it) replays the whole model."""
    if engine.family.encoder:
        raise UnsupportedModelError(f"Expected a causal language model for {what}. Got the {engine.family.name} "
                                    "encoder, which predicts no next token.")
    if any(p.is_meta for p in engine.model.parameters()):
        raise InvalidArgumentError(f"Expected an engine with the whole model in memory for {what}. Got the "
                                   "layer-streamed engine; load the model without a memory budget instead.")


def check_edits(engine: Engine, edits: Sequence[Edit], n_tokens: int) -> list[_Unit]:
    """Where each edit acts, once each is checked against the model and a prompt of ``n_tokens`` tokens.

    Raises
    ------
    InvalidArgumentError
        No edit, or an edit's kind, layer, index, position, mode or value out of range (what was expected, what
        was got).
    UnsupportedModelError
        A neuron edit in a mixture-of-experts MLP.
    """
    if not edits:
        raise InvalidArgumentError("Expected at least one edit. Got none instead.")
    family = engine.family
    layers = family.layers(family.decoder(engine.model))
    units = []
    for e in edits:
        if not isinstance(e, Edit):
            raise InvalidArgumentError(f"Expected an Edit. Got a {type(e).__name__} instead.")
        _in_range("edit kind", e.kind, KINDS)
        _in_range("edit mode", e.mode, MODES)
        _below(e, "layer", e.layer, len(layers))
        _below(e, "position", e.position, n_tokens)
        module, width, size = (_head_site if e.kind == "head" else down_projection)(engine, layers[e.layer], e.layer)
        _below(e, e.kind, e.index, width // size)
        _check_value(e, size)
        units.append(_Unit(module, e.position, slice(e.index * size, (e.index + 1) * size), e))
    return units


def _in_range(what: str, got: Any, allowed: Sequence[str]) -> None:
    if got not in allowed:
        raise InvalidArgumentError(f"Expected an {what} among {', '.join(allowed)}. Got {got!r} instead.")


def _below(e: Edit, what: str, got: Any, n: int) -> None:
    if isinstance(got, bool) or not isinstance(got, int) or not 0 <= got < n:
        raise InvalidArgumentError(f"Expected a {what} in [0, {n}) for the edit {_name(e)}. Got {got!r} instead.")


def _name(e: Edit) -> str:
    return f"{e.kind} {e.index} of layer {e.layer} at position {e.position}"


def _check_value(e: Edit, size: int) -> None:
    if e.mode != "clamp":
        if e.value is not None:
            raise InvalidArgumentError(f"Expected no value with the mode {e.mode!r} ({_name(e)}). Got {e.value!r} "
                                       "instead; a value is for 'clamp'.")
        return
    value = e.value
    sizes = (1,) if e.kind == "neuron" else (1, size)
    n = len(value) if isinstance(value, Sequence) and not isinstance(value, str) else 1 if _number(value) else None
    ok = n in sizes and all(_number(v) for v in (value if isinstance(value, Sequence) else [value]))
    if not ok:
        want = "a number" if e.kind == "neuron" else f"a number or {size} numbers (the head's output)"
        raise InvalidArgumentError(f"Expected {want} to clamp {_name(e)} to. Got {value!r} instead.")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _head_site(engine: Engine, layer: nn.Module, index: int) -> tuple[nn.Module, int, int]:
    """(the attention's output projection, its input width, head_dim)."""
    attention = next(m for m in layer.modules() if isinstance(m, engine.family.attentions))
    out = getattr(attention, "o_proj", None) or attention.c_proj
    heads = engine.config.get_text_config().num_attention_heads
    width = _in_width(out)
    return out, width, width // heads


def down_projection(engine: Engine, layer: nn.Module, index: int, what: str = "a neuron edit"
                    ) -> tuple[nn.Module, int, int]:
    """(the MLP's down projection of decoder layer ``layer``, number ``index``; its input width (the neurons); 1):
    its input is the layer's neuron values, as the attribution graphs number them; ``what`` needs it (the error's
    words)."""
    family = engine.family
    for m in layer.modules():
        if (rule := family.mlp_rule(m)) is not None:
            down = getattr(m, rule.down)
            return down, _in_width(down), 1
        if family.moe_rule(m) is not None:
            raise UnsupportedModelError(f"Expected a dense MLP for {what}. Got {family.name}'s mixture of "
                                        f"experts at layer {index}, whose neurons have no single down projection.")
    mlp = getattr(layer, "mlp", None)
    down = next((getattr(mlp, n) for n in _UNGATED_DOWN if hasattr(mlp, n)), None)
    if down is None:
        raise UnsupportedModelError(f"Expected an MLP with a down projection ({', '.join(_UNGATED_DOWN)}) at layer "
                                    f"{index} of this {family.name} model. Got none.")
    return down, _in_width(down), 1


def _in_width(proj: nn.Module) -> int:
    """Input features of a projection: ``nn.Linear`` (out, in) or GPT-2's ``Conv1D`` (in, out)."""
    return int(getattr(proj, "in_features", None) or proj.nx)


@contextmanager
def _hooks(units: Sequence[_Unit], hook: Any) -> Iterator[None]:
    """Forward pre-hooks ``hook(k, args)`` on each unit's module (k: the unit's index), removed on exit even on
    error."""
    handles = []
    try:
        for k, u in enumerate(units):
            handles.append(u.module.register_forward_pre_hook(lambda m, args, k=k: hook(k, args)))
        yield
    finally:
        for h in handles:
            h.remove()


def _recording(units: Sequence[_Unit], seen: list[torch.Tensor]) -> Any:
    """A context in which each unit's values on the prompt (n, size) are written into ``seen`` as its module runs."""
    def record(k: int, args: tuple[Any, ...]) -> None:
        seen[k] = args[0][0, :, units[k].cols].detach().clone()

    return _hooks(units, record)


@contextmanager
def _replacing(units: Sequence[_Unit], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """Each unit's input at its position and columns replaced by its value (width,) while the block runs."""
    def replace(k: int, args: tuple[Any, ...]) -> tuple[Any, ...]:
        u, x = units[k], args[0].clone()  # (1, n, width)
        x[0, u.position, u.cols] = values[k].to(x.dtype)
        return (x, *args[1:])

    with _hooks(units, replace):
        yield


def _frozen_pass(engine: Engine, input_ids: torch.Tensor, units: Sequence[_Unit]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The frozen system's logits (vocab,) without and with the edits, and the value (size,) each edit sets (from
    the unit's values on the prompt, what ``mean`` averages): the factors recorded on the prompt, replayed with the
    edits."""
    seen: list[torch.Tensor] = [torch.empty(0)] * len(units)
    tape = FactorTape()
    with linearized(engine.model, detach=True, convention=engine.convention) as lin, torch.no_grad():
        with tape.recording(), _recording(units, seen):
            h0 = lin.decoder(input_ids=input_ids, use_cache=False).last_hidden_state[0, -1]
        values = [_new_value(u, s) for u, s in zip(units, seen, strict=True)]
        with tape.replaying_factors(), _replacing(units, values):
            h1 = lin.decoder(input_ids=input_ids, use_cache=False).last_hidden_state[0, -1]
    return engine.logits(h0), engine.logits(h1), values


def _new_value(u: _Unit, seen: torch.Tensor) -> torch.Tensor:
    """The value (size,) an edit sets, from the unit's values on the prompt ``seen`` (n, size)."""
    e = u.edit
    if e.mode == "zero":
        return torch.zeros_like(seen[0])
    if e.mode == "mean":
        return seen.mean(0)
    value = torch.as_tensor(e.value, dtype=seen.dtype, device=seen.device).reshape(-1)
    return value.expand(seen.shape[1]).clone()


def _column(engine: Engine, logits: torch.Tensor, base: torch.Tensor, target: int, k: int) -> Column:
    """The top ``k`` of ``logits`` (vocab,), and the target's logit change from ``base``."""
    logits = logits.detach().to("cpu", torch.float64)
    probs = torch.softmax(logits, -1)
    top = torch.topk(logits, k)
    ids = top.indices.tolist()
    return Column(ids, token_labels(engine.tokenizer, ids), top.values.tolist(), probs[ids].tolist(),
                  float(logits[target]), float(logits[target] - base.detach().to("cpu", torch.float64)[target]))
