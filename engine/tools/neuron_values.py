"""What a neuron index (``detjac neurons``) reads of the engine: every MLP neuron's value on one prompt, and each
neuron's write vector through the unembedding (its logit effects).

A neuron is the attribution graph's (docs/graphs.md): ``z = gate · (W_up norm(r))`` at each position, per expert for a
mixture of experts (zero where a position is not routed to the expert), read from the engine's
:meth:`~detjac.engine.Engine.walk` of the prompt's trace, so the index and the graphs name the same numbers, on
either engine (the layer-streamed one holds one layer at a time). Not guaranteed: a write vector's logit effects leave
out the final norm's per-position scale and any norm after the MLP (positive scales: the order of the tokens is the
same), as the graph's labels do; an expert that no position of the probe prompt was routed to has none (NaN)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ..interface import Engine
from .neurons import activations, neurons


def neuron_values(engine: Engine, batch: Sequence[Sequence[int]]) -> list[dict[int, np.ndarray]]:
    """Each prompt's ``{layer: (n, n_neurons) float64 values}`` of every layer's MLP neurons: through one forward pass
    of the whole batch where that applies (:func:`batch_neuron_values`), else one trace per prompt
    (:func:`prompt_neuron_values`): the same numbers either way (to float64 rounding, tested)."""
    values = batch_neuron_values(engine, batch)
    return values if values is not None else [dict(prompt_neuron_values(engine, ids)) for ids in batch]


def prompt_neuron_values(engine: Engine, token_ids: Sequence[int]) -> Iterator[tuple[int, np.ndarray]]:
    """``(layer, (n, n_neurons) float64 values)`` of every layer's MLP neurons on the prompt ``token_ids``, one
    layer at a time; raises InvalidArgumentError for an engine without neuron sites (the ordinary Jacobian)."""
    trace = engine.trace(list(token_ids))
    for layer, z in activations(engine, trace):
        yield layer, z.detach().to("cpu", torch.float64).numpy()


def batch_neuron_values(engine: Engine, batch: Sequence[Sequence[int]]) -> list[dict[int, np.ndarray]] | None:
    """Each prompt's ``{layer: (n, n_neurons) float64 values}`` from one forward pass of the loaded model over the
    whole batch (right-padded: a causal model's real positions never see the padding), each gated MLP's neuron values
    read at its down projection's input (``act(gate(x)) · up(x)``: the walk's numbers to rounding, tested); many
    times faster than a trace per prompt. None where that does not apply (the layer-streamed engine, the ordinary
    Jacobian, a convention, a mixture of experts, an ungated, affine or encoder family): use
    :func:`prompt_neuron_values` then."""
    from ..detach.model import linearized
    from ..inmemory.inmemory_engine import InMemoryEngine

    family = engine.family
    if (not isinstance(engine, InMemoryEngine) or not engine.detach or engine.convention != family.conventions[0]
            or family.affine or family.encoder or not batch):
        return None
    model = engine.model
    if any(family.moe_rule(m) is not None for m in model.modules()):
        return None
    mlps = [(m, rule) for m in model.modules() if (rule := family.mlp_rule(m)) is not None]
    if len(mlps) != engine.n_layers:
        return None
    seen: dict[int, torch.Tensor] = {}
    hooks = [getattr(m, rule.down).register_forward_pre_hook(
        lambda _m, args, layer=layer: seen.__setitem__(layer, args[0].detach()))
        for layer, (m, rule) in enumerate(mlps)]
    lengths = [len(ids) for ids in batch]
    padded = torch.zeros(len(batch), max(lengths), dtype=torch.long, device=engine.device)
    for row, ids in enumerate(batch):
        padded[row, :len(ids)] = torch.as_tensor(list(ids))
    try:  # detached (the walk's norms: in the compute dtype, where a stock norm may round through float32)
        with linearized(model, detach=True, convention=engine.convention) as lin, torch.no_grad():
            lin.decoder(input_ids=padded, use_cache=False)
    finally:
        for handle in hooks:
            handle.remove()
    out: list[dict[int, np.ndarray]] = [{} for _ in batch]
    for layer in range(engine.n_layers):
        z = seen.pop(layer).to("cpu", torch.float64).numpy()  # (batch, longest, n_neurons)
        for row, n in enumerate(lengths):
            out[row][layer] = z[row, :n]
    return out


def write_effects(engine: Engine, probe: Sequence[int], top: int, chunk: int = 256
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Each neuron's write vector through the unembedding: ``(ids, values)``, each (layers, n_neurons, 2, top),
    ``[..., 0, :]`` the tokens it raises most, ``[..., 1, :]`` those it lowers most (values per unit of the neuron's
    value, before the final norm); ids -1 and values NaN where a neuron has no write vector on the ``probe``
    prompt's trace (an expert not routed to). ``chunk`` neurons are decoded at a time."""
    W_U = engine.decoding_matrices(torch.float32)["unembedding"]  # (vocab, d)
    top = min(top, int(W_U.shape[0]))
    trace = engine.trace(list(probe))
    ids_out, values_out = [], []
    for _, _, mlp in neurons(engine, trace):
        w = mlp.write_vectors().detach().to("cpu", torch.float32)  # (n_neurons, d)
        del mlp  # it holds the layer's widened weights: not while the next layer is widened
        ids = np.full((w.shape[0], 2, top), -1, dtype=np.int64)
        values = np.full((w.shape[0], 2, top), np.nan)
        for c0 in range(0, w.shape[0], chunk):
            block = w[c0:c0 + chunk]
            ok = torch.isfinite(block).all(dim=1)
            if not bool(ok.any()):
                continue
            rows = ok.nonzero().reshape(-1)
            logits = block[rows] @ W_U.T  # (m, vocab)
            for sign, largest in ((0, True), (1, False)):
                t = torch.topk(logits, top, dim=1, largest=largest)
                ids[c0 + rows.numpy(), sign] = t.indices.numpy()
                values[c0 + rows.numpy(), sign] = t.values.double().numpy()
        ids_out.append(ids)
        values_out.append(values)
    return np.stack(ids_out), np.stack(values_out)
