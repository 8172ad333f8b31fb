"""A whole loaded model's frozen pieces, recorded in one forward pass: the in-memory explicit sweeps.

:func:`freeze_model` records every layer's pieces and the norms outside the layers as a :class:`FrozenModel`, checked
against each layer's and the model's own output before it is trusted. Details: docs/engine.md, "Explicit sweeps in
the in-memory engine"."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..detach.factors import FactorTape
from ..detach.wrappers import DetachedNorm
from ..interface import EngineStats
from ..pieces.layer import NormPiece, check_layer, norm_piece, pull_layer, push_layer
from ..pieces.record import LayerRecord, record_layer
from ..pieces.runner import run_layer


@dataclass
class FrozenModel:
    """A prompt's detached model as frozen pieces (see the module docstring)."""

    layers: list[LayerRecord]
    before: list[NormPiece]  # between the input embeddings and the first layer: scales (n,)
    after: list[NormPiece]  # after the last layer, at the position: scales (1,)
    position: int
    n: int  # positions
    stats: EngineStats = field(default_factory=EngineStats)

    def _pieces(self, record: LayerRecord) -> Any:
        pieces = record.pieces()
        assert not isinstance(pieces, str), pieces  # built once before, by freeze_model
        self.stats.explicit_layers += 1
        return pieces

    def pull(self, u: torch.Tensor) -> torch.Tensor:
        """``J^T u``: (c, d) cotangents of the output -> (c, n, d) at the input embeddings."""
        p, n = self.position, self.n
        with torch.no_grad():
            top = u[:, None]
            for norm in reversed(self.after):
                top = norm.transpose(top)
            g = u.new_zeros(u.shape[0], n, u.shape[1])
            g[:, p] = top[:, 0]
            s = p  # the cotangents are zero before the position
            for record in reversed(self.layers):
                g, s = pull_layer(self._pieces(record), g, None, s if s < n else 0)
            for norm in reversed(self.before):
                g = norm.transpose(g)
            return g

    def push(self, v: torch.Tensor) -> torch.Tensor:
        """``J v``: (c, n, d) tangents of the input embeddings -> (c, d) at the output."""
        with torch.no_grad():
            for norm in self.before:
                v = norm.apply(v)
            for record in self.layers:
                v = push_layer(self._pieces(record), v, 0)[0]
            y = v[:, self.position:self.position + 1]
            for norm in self.after:
                y = norm.apply(y)
            return y[:, 0]


def freeze_model(lin: Any, x: torch.Tensor, position: int
                 ) -> tuple[FrozenModel | str, torch.Tensor, torch.Tensor | None]:
    """Run the linearized model ``lin`` (:class:`~detjac.engine.detach.model.Linearized`, detached) on ``x`` (n, d)
    once, recording its pieces; return them (or why they are not all known pieces), the output (d,) at
    ``position`` (``0 <= position < n``) and the offset ``b`` (d,) of an affine family (else None)."""
    family, decoder = lin.family, lin.decoder
    layers = list(family.layers(decoder))
    tape = FactorTape()
    events: list[tuple[Any, ...]] = []  # ("norm", module, factor) and ("layer", record or why, first, end)
    inside = {id(m) for layer in layers for m in layer.modules()}
    handles = [m.register_forward_pre_hook(lambda m, a: events.append(("norm", m, len(tape.factors))))
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
    if not isinstance(frozen, str):
        got = frozen.push(x[None])[0] + (bias if bias is not None else 0)
        err = float((got - output).norm() / output.norm().clamp_min(torch.finfo(output.dtype).tiny))
        bound = {torch.float64: 1e-9, torch.float32: 1e-3}.get(x.dtype, 5e-2)
        if not err <= bound:
            frozen = f"its pieces rebuild the model's output with relative error {err:.1e} (bound {bound:g})"
    return frozen, output, bias


def _recorder(layer: nn.Module, family: Any, tape: FactorTape, events: list[tuple[Any, ...]]) -> Any:
    """A forward for ``layer``'s instance that runs the layer once while :func:`record_layer` records it."""
    original, mid_module = layer.forward, getattr(layer, family.mid_residual, None)

    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raw: list[Any] = []

        def step(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (n, d) -> (out, mid)
            result, out, seen = run_layer(lambda x: original(x, *args, **kwargs), mid_module, h)
            raw.append(result)
            return out, (seen[0].squeeze(0) if seen else out)

        first = len(tape.factors)
        record, out, mid = record_layer(layer, family, step, hidden[0], tape)
        if not isinstance(record, str):
            pieces = record.pieces()
            problem = pieces if isinstance(pieces, str) else check_layer(pieces, hidden[0], out, mid)
            record = problem if problem is not None else record
        events.append(("layer", record, first, len(tape.factors)))
        return raw[0]

    return forward


def _assemble(events: list[tuple[Any, ...]], tape: FactorTape, n_layers: int, position: int, n: int
              ) -> FrozenModel | str:
    """The recorded events as a :class:`FrozenModel`: norms, then the layers in order, then norms."""
    kinds = [e[0] for e in events]
    if kinds.count("layer") != n_layers:
        return f"{kinds.count('layer')} of its {n_layers} layers ran"
    first, last = kinds.index("layer"), n_layers - 1 + kinds.index("layer")
    if kinds[first:last + 1] != ["layer"] * n_layers:
        return "a norm between its layers"
    used = sum(e[3] - e[2] for e in events if e[0] == "layer") + kinds.count("norm")
    if used != len(tape.factors):
        return f"{len(tape.factors) - used} frozen factors outside its layers and norms"
    for i, e in enumerate(events[first:last + 1]):
        if isinstance(e[1], str):
            return f"layer {i}: {e[1]}"
    norms = [norm_piece(e[1], tape.factors[e[2]].reshape(-1)) for e in events[:first] + events[last + 1:]]
    problem = next((nm for nm in norms if isinstance(nm, str)), None)
    if problem is not None:
        return problem
    after = [NormPiece(nm.scale[position:position + 1], nm.gain, nm.center) for nm in norms[first:]]
    return FrozenModel([e[1] for e in events[first:last + 1]], norms[:first], after, position, n)
