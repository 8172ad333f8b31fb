"""A whole loaded model's frozen pieces, recorded in one forward pass: the in-memory explicit sweeps.

:func:`freeze_model` records every layer's pieces and the norms outside the layers as a :class:`FrozenModel`, checked
against each layer's and the model's own output before it is trusted, or refuses the model with the reason
(:class:`~detjac.engine.pieces.NotAPiece`, caught by :mod:`detjac.engine.inmemory.rows`, which falls back).
Details: docs/engine.md, "Explicit sweeps in the in-memory engine"."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..detach.factors import FactorTape
from ..detach.wrappers import DetachedNorm
from ..pieces import NotAPiece
from ..pieces.layer import LayerPieces, PiecesPull, check_layer, check_rebuilt, push_layer
from ..pieces.norms import NormPiece, norm_piece
from ..pieces.record import LayerRecord, record_layer
from ..pieces.runner import run_layer
from ..pullback import OUTPUT, PullRequest, Seed
from ..types import EngineStats


@dataclass
class Event:
    """One call seen while the model ran: a norm outside the layers (``module``, its factor at ``first``) or a layer
    (its ``record``, or ``why`` it is not made of known pieces; its factors ``first:end``; its mid residual (n, d))."""

    kind: str  # "norm" or "layer"
    first: int
    module: nn.Module | None = None
    record: LayerRecord | None = None
    end: int = 0
    mid: torch.Tensor | None = None
    why: str | None = None  # a layer not made of known pieces: why
    states: tuple[torch.Tensor, torch.Tensor] | None = None  # the layer's (input, output) on the prompt (n, d)


@dataclass
class FrozenModel:
    """A prompt's detached model as frozen pieces (see the module docstring): a
    :class:`~detjac.engine.pullback.Walk`, so every pullback goes through :func:`~detjac.engine.pullback.pulls`."""

    layers: list[LayerRecord]
    before: list[NormPiece]  # between the input embeddings and the first layer: scales (n,)
    after: list[NormPiece]  # after the last layer, every position: scales (n,)
    position: int
    n: int  # positions
    stats: EngineStats = field(default_factory=EngineStats)
    mids: list[torch.Tensor] = field(default_factory=list, repr=False)  # mids[l]: layer l's mid residual (n, d)
    inputs: list[torch.Tensor] = field(default_factory=list, repr=False)  # inputs[l]: layer l's input, [L]: output

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_tokens(self) -> int:
        return self.n

    def pieces(self, i: int) -> LayerPieces:
        """Layer ``i``'s pieces, norms folded in (built anew: nothing is kept between sweeps)."""
        pieces = self.layers[i].pieces()  # built once before, by freeze_model: known pieces
        self.stats.explicit_layers += 1
        return pieces

    # -- the Walk of the pullback primitive ----------------------------------------------

    def supports(self, request: PullRequest) -> str | None:
        needs = request.cut or any(s.site.kind == "neurons" for s in request.seeds) or any(
            r.kind == "neurons" for r in request.reads)
        post = next((i for i, r in enumerate(self.layers) if r.fixed is not None), None)
        if needs and post is not None:
            return f"layer {post} is a post-norm layer, whose MLP output is not a site of the residual stream"
        return None

    def final(self, seed: Seed) -> torch.Tensor:
        p, u = self.position, seed.values
        if seed.site == OUTPUT:  # (B, d) at the position
            top = u[:, None]
            for norm in reversed(self.after):
                top = NormPiece(norm.scale[p:p + 1], norm.gain, norm.center).transpose(top)
            g = u.new_zeros(u.shape[0], self.n, u.shape[1])
            g[:, p] = top[:, 0]
            return g
        for norm in reversed(self.after):  # every position, each through its own norm
            u = norm.transpose(u)
        return u

    @contextmanager
    def layer(self, i: int) -> Iterator[PiecesPull]:
        yield PiecesPull(self.pieces(i), self.mids[i] if self.mids else None, self.inputs[i] if self.inputs else None)

    def embed(self, g: torch.Tensor) -> torch.Tensor:
        for norm in reversed(self.before):
            g = norm.transpose(g)
        return g

    def enter(self, t: torch.Tensor) -> torch.Tensor:
        for norm in self.before:
            t = norm.apply(t)
        return t

    def residual_ends(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.inputs, "freeze_model records the residual stream entering and leaving each layer"
        return self.inputs[0], self.inputs[-1]

    # -- the output's J v ------------------------------------------------------------------

    def push(self, v: torch.Tensor) -> torch.Tensor:
        """``J v``: (c, n, d) tangents of the input embeddings -> (c, d) at the output."""
        p = self.position
        with torch.no_grad():
            for norm in self.before:
                v = norm.apply(v)
            for i in range(self.n_layers):
                v = push_layer(self.pieces(i), v, 0)[0]
            y = v[:, p:p + 1]
            for norm in self.after:
                y = NormPiece(norm.scale[p:p + 1], norm.gain, norm.center).apply(y)
            return y[:, 0]


def freeze_model(lin: Any, x: torch.Tensor, position: int) -> tuple[FrozenModel, torch.Tensor, torch.Tensor | None]:
    """Run the linearized model ``lin`` (:class:`~detjac.engine.detach.model.Linearized`, detached) on ``x`` (n, d)
    once, recording its pieces; return them, the output (d,) at ``position`` (``0 <= position < n``) and the offset
    ``b`` (d,) of an affine family (else None). Raises :class:`~detjac.engine.pieces.NotAPiece` (why) where they
    are not all known pieces or do not rebuild the model's output."""
    family, decoder = lin.family, lin.decoder
    layers = list(family.layers(decoder))
    tape = FactorTape()
    events: list[Event] = []
    inside = {id(m) for layer in layers for m in layer.modules()}
    handles = [m.register_forward_pre_hook(lambda m, a: events.append(Event("norm", len(tape.factors), m)))
               for m in decoder.modules() if isinstance(m, DetachedNorm) and id(m) not in inside]
    own = [layer.__dict__.get("forward") for layer in layers]  # a forward already set on an instance stays
    for layer in layers:
        layer.forward = _recorder(layer, family, tape, events)
    try:
        with tape.recording(), torch.no_grad():
            hidden = decoder(inputs_embeds=x[None], use_cache=False).last_hidden_state[0]  # (n, d)
    finally:
        for handle in handles:
            handle.remove()
        for layer, forward in zip(layers, own, strict=True):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
    bias = None
    if family.affine:  # the factors of x on zero inputs: only the offsets remain
        with tape.replaying_factors(), torch.no_grad():
            bias = decoder(inputs_embeds=torch.zeros_like(x)[None], use_cache=False).last_hidden_state[0, position]
    frozen = _assemble(events, tape, len(layers), position, x.shape[0])
    output = hidden[position]
    check_rebuilt(frozen.push(x[None])[0] + (bias if bias is not None else 0), output, "the model's output")
    return frozen, output, bias


def _recorder(layer: nn.Module, family: Any, tape: FactorTape, events: list[Event]) -> Any:
    """A forward for ``layer``'s instance that runs the layer once while :func:`record_layer` records it."""
    original, mid_module = layer.forward, getattr(layer, family.mid_residual, None)

    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raw: list[Any] = []

        def step(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (n, d) -> (out, mid)
            result, out, seen = run_layer(lambda x: original(x, *args, **kwargs), mid_module, h)
            raw.append(result)
            return out, (seen[0].squeeze(0) if seen else out)

        first = len(tape.factors)
        try:
            record, out, mid = record_layer(layer, family, step, hidden[0], tape)
            check_layer(record.pieces(), hidden[0], out, mid)
        except NotAPiece as e:  # the forward goes on: the model's other checks come first (_assemble)
            events.append(Event("layer", first, end=len(tape.factors), why=str(e)))
        else:
            if record.offsets is not None:  # the layer's own values, not only their linear parts
                out, mid = out + record.offsets.out, mid + record.offsets.mid
            events.append(Event("layer", first, record=record, end=len(tape.factors), mid=mid,
                                states=(hidden[0], out)))
        return raw[0]

    return forward


def _assemble(events: list[Event], tape: FactorTape, n_layers: int, position: int, n: int) -> FrozenModel:
    """The recorded events as a :class:`FrozenModel`: norms, then the layers in order, then norms; raises
    :class:`~detjac.engine.pieces.NotAPiece` (why) where they are not that."""
    kinds = [e.kind for e in events]
    if kinds.count("layer") != n_layers:
        raise NotAPiece(f"{kinds.count('layer')} of its {n_layers} layers ran")
    first, last = kinds.index("layer"), n_layers - 1 + kinds.index("layer")
    if kinds[first:last + 1] != ["layer"] * n_layers:
        raise NotAPiece("a norm between its layers")
    used = sum(e.end - e.first for e in events if e.kind == "layer") + kinds.count("norm")
    if used != len(tape.factors):
        raise NotAPiece(f"{len(tape.factors) - used} frozen factors outside its layers and norms")
    layers = events[first:last + 1]
    for i, e in enumerate(layers):
        if e.why is not None:
            raise NotAPiece(f"layer {i}: {e.why}")
    norms = [norm_piece(e.module, tape.factors[e.first].reshape(-1)) for e in events[:first] + events[last + 1:]]
    return FrozenModel([e.record for e in layers], norms[:first], norms[first:], position, n,  # type: ignore[misc]
                       mids=[e.mid for e in layers],  # type: ignore[misc]
                       inputs=[e.states[0] for e in layers] + [layers[-1].states[1]])  # type: ignore[index]
