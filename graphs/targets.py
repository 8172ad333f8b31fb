"""The logit targets of an attribution graph and the ranking of its candidate neurons (:mod:`detjac.graphs.build`):
each target as a vector ``w`` with ``w · y`` its value (a demeaned logit, or a contrast of two logits), every
token's signed contribution to it and every neuron's total attribution to it from one pullback, and the neurons kept.
Definitions: docs/graphs.md, "Targets"."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from detjac.engine import EMBEDDINGS, OUTPUT, Engine, PullRequest, Seed, activations, neurons_of
from detjac.errors import InvalidArgumentError
from detjac.graph_settings import GraphSettings, parse_target
from detjac.singular import VOCAB_CHUNK_BYTES
from detjac.tokens import token_labels


@dataclass
class LogitTargets:
    ids: list[int]
    probabilities: np.ndarray  # (K,)
    vectors: torch.Tensor  # (K, d): value_k = vectors[k] @ y
    values: torch.Tensor  # (K,)
    minus: int | None = None  # a contrast's second token (one target): value = logit(ids[0]) - logit(minus)
    text: str | None = None  # the asked target as written back (GraphSettings.target), None for the top logits


def graph_targets(engine: Engine, output: torch.Tensor, y: torch.Tensor, settings: GraphSettings) -> LogitTargets:
    """A graph's logit targets: the top logits of the prompt's own output ``output`` (the settings' ``max_logits``
    until ``logit_probability``), or the one asked target (``settings.target``: a token's demeaned logit, or a
    contrast ``w_a - w_b`` of two, the mean cancelling); each target's value taken on ``y``, the final normed state
    of the system the graph is of (the prompt's own, or with the first position set aside).

    Raises
    ------
    InvalidArgumentError
        A target token that is not one token of the model's vocabulary.
    """
    if settings.target is None:
        targets = logit_targets(engine, output, settings.max_logits, settings.logit_probability)
    else:
        asked = parse_target(settings.target)
        ids = [token_id(engine, asked.plus)] + ([] if asked.minus is None else [token_id(engine, asked.minus)])
        both = logit_targets(engine, output, len(ids), 1.0, ids)
        vectors = both.vectors[:1] - both.vectors[1:] if len(ids) == 2 else both.vectors
        targets = LogitTargets(ids[:1], both.probabilities[:1], vectors, both.values[:1],
                               ids[1] if len(ids) == 2 else None, asked.text)
    with torch.no_grad():  # the values are the graph's system's (the probabilities stay the prompt's)
        targets.values = targets.vectors @ y.to(targets.vectors)
    return targets


def token_id(engine: Engine, token: str | int) -> int:
    """The id of ``token``: an id (checked against the vocabulary) or the text of one token (as the graph labels
    tokens).

    Raises
    ------
    InvalidArgumentError
        An id outside the vocabulary, text without a tokenizer, or text that the tokenizer does not read as exactly
        that one token.
    """
    if isinstance(token, int):
        vocab = int(engine.prompt_model().get_input_embeddings().num_embeddings)  # what prompts' ids are checked by
        if not 0 <= token < vocab:
            raise InvalidArgumentError(f"Expected a target token id in [0, {vocab}). Got #{token}.")
        return token
    if engine.tokenizer is None:
        raise InvalidArgumentError(f"Expected target tokens by id (#ID) for a model without a tokenizer. Got "
                                   f"{token!r}.")
    ids = engine.tokenizer.encode(token, add_special_tokens=False)
    labels = token_labels(engine.tokenizer, ids)
    if len(ids) != 1 or labels[0] != token:
        raise InvalidArgumentError(f"Expected {token!r} to be one token of the model's vocabulary (as the graph "
                                   f"labels tokens). Got {len(ids)} token{'s' * (len(ids) != 1)}: "
                                   f"{', '.join(map(repr, labels)) or 'none'}.")
    return int(ids[0])




def logit_vectors(engine: Engine, y: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """(K, d) the vectors ``w_t`` with ``w_t · y`` the demeaned logit of each token of ``ids`` (see
    :func:`logit_targets`)."""
    return logit_targets(engine, y, len(ids), 1.0, ids).vectors


def logit_targets(engine: Engine, y: torch.Tensor, max_logits: int, probability: float,
                   ids: list[int] | None = None) -> LogitTargets:
    """The top logits until ``probability`` (at most ``max_logits``), each as a vector ``w`` with ``w · y`` its
    demeaned logit: ``r_t W_U[t] - mean_v r_v W_U[v]``, ``r`` the final soft-cap's frozen ratio (1 without one)."""
    W = engine.decoding_rows(torch.float64 if y.dtype == torch.float64 else torch.float32)["unembedding"]  # (V, d)
    vocab = int(W.shape[0])
    # a matrix already in memory in one piece; rows read on demand (the layer-streamed engine's) a chunk at a time
    step = vocab if isinstance(W, np.ndarray) else max(1, VOCAB_CHUNK_BYTES // (int(W.shape[1]) * y.element_size()))
    spans = [(a, min(vocab, a + step)) for a in range(0, vocab, step)]

    def rows(a: int, b: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(W[a:b])).to(device=y.device, dtype=y.dtype)

    with torch.no_grad():
        raw = torch.cat([rows(a, b) @ y for a, b in spans])
        logits = engine.logits(y).to(y.dtype)
        ratio = torch.where(raw != 0, logits / torch.where(raw != 0, raw, torch.ones_like(raw)), torch.ones_like(raw))
        probs = torch.softmax(logits.double(), dim=-1)
        if ids is None:
            top = torch.sort(probs, descending=True)
            k = int(torch.searchsorted(top.values.cumsum(0), torch.tensor(probability, dtype=torch.float64))) + 1
            chosen = top.indices[:min(k, max_logits)]
        else:
            chosen = torch.as_tensor(ids, dtype=torch.long, device=y.device)
        total = sum(ratio[a:b] @ rows(a, b) for a, b in spans)  # (d,): never a (V, d) temporary in the compute dtype
        mean = total / vocab
        picked = torch.cat([rows(int(i), int(i) + 1) for i in chosen.tolist()])
        vectors = ratio[chosen, None] * picked - mean
    return LogitTargets([int(i) for i in chosen], probs[chosen].cpu().numpy(), vectors, vectors @ y)


def logit_attribution(engine: Engine, trace: Any, vectors: torch.Tensor, acts: dict[int, torch.Tensor] | None = None
                      ) -> Iterator[tuple[int, torch.Tensor]]:
    """Every neuron's total attribution to the logits ``vectors`` (K, d) (``value_k = vectors[k] · y``):
    ``(layer, (K, n, n_neurons) act · ∂value_k/∂act)`` through every path of the detached model (nothing cut), one
    layer at a time, from one pullback. By linearity, zeroing a set of neurons changes ``value_k`` by minus the sum
    of their attributions in the detached model (what the graphs' faithfulness is measured against)."""
    acts = acts if acts is not None else dict(activations(engine, trace))
    yield from _attributions(engine, trace, vectors, acts)


def _attributions(engine: Engine, trace: Any, vectors: torch.Tensor, acts: dict[int, torch.Tensor],
                  x: torch.Tensor | None = None) -> Iterator[tuple[int | None, torch.Tensor]]:
    """One pullback of ``vectors`` (K, d) from the output: ``(layer, (K, n, n_neurons))`` every neuron's total
    attribution, layer by layer, and with ``x`` (n, d) the input embeddings also ``(None, (K, n))`` each token's,
    ``∂value/∂x_q · x_q`` (:func:`logit_attribution`, :func:`rank_neurons`)."""
    reads = tuple(neurons_of(layer) for layer in range(engine.n_layers)) + ((EMBEDDINGS,) if x is not None else ())
    for _, site, g in engine.pulls(trace, [PullRequest((Seed(OUTPUT, vectors),), reads)]):
        if site == EMBEDDINGS:
            yield None, (g * x.to(g)[None]).sum(-1)
        else:
            yield site.layer, g * acts[site.layer][None]


def rank_neurons(engine: Engine, trace: Any, targets: LogitTargets, acts: dict[int, torch.Tensor], max_nodes: int,
                 x: torch.Tensor | None = None) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """The ``max_nodes`` neurons with the largest total attribution to the logits (``sum_k p_k |act ·
    ∂logit_k/∂act| / |logit_k|``, through every path), as (M, 3) (layer, index, position) sorted by layer,
    position, index; how many were active (nonzero, at or before the position); and with ``x`` (n, d), the system's
    input embeddings (zero at a position set aside), (K, n) each token's exact signed contribution to each target
    from the same pullback (over the tokens they sum to the value, less an affine family's constants), else None."""
    p = trace.position
    weights = torch.as_tensor(targets.probabilities, dtype=targets.values.dtype, device=targets.values.device)
    weights = weights / targets.values.abs().clamp_min(torch.finfo(targets.values.dtype).tiny)
    scores: dict[int, torch.Tensor] = {}
    contributions = None
    for layer, attr in _attributions(engine, trace, targets.vectors, acts, x):
        if layer is None:
            contributions = attr
            continue
        scores[layer] = torch.einsum("k,knf->nf", weights, attr.abs())[:p + 1]
    flat = torch.cat([scores[layer].reshape(-1) for layer in range(engine.n_layers)])
    active = torch.cat([acts[layer][:p + 1].ne(0).reshape(-1) for layer in range(engine.n_layers)])
    flat = torch.where(active, flat, torch.full_like(flat, -1.0))
    n_active = int(active.sum())
    keep = torch.topk(flat, min(max_nodes, n_active)).indices if n_active else flat.new_zeros(0, dtype=torch.long)
    width = torch.tensor([scores[layer].numel() for layer in range(engine.n_layers)])
    starts = torch.cumsum(width, 0) - width
    layer = torch.searchsorted(starts, keep.cpu(), right=True) - 1
    within = keep.cpu() - starts[layer]
    n_neurons = torch.tensor([acts[layer_].shape[1] for layer_ in range(engine.n_layers)])
    pos, index = within // n_neurons[layer], within % n_neurons[layer]
    chosen = torch.stack([layer, index, pos], dim=1)
    order = np.lexsort((chosen[:, 1].numpy(), chosen[:, 2].numpy(), chosen[:, 0].numpy()))
    return chosen[torch.as_tensor(order, dtype=torch.long)], n_active, contributions


def chosen_values(acts: dict[int, torch.Tensor], chosen: torch.Tensor) -> torch.Tensor:
    if chosen.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack([acts[int(layer)][int(pos), int(index)] for layer, index, pos in chosen.tolist()])
