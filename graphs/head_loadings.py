"""Head loadings of an attribution graph's links: through which attention heads each link travels, exactly.

In the cut model that defines a graph's links (attention probabilities and norm scales frozen, every MLP's output
held at its neurons), the heads of a layer act in parallel, so the value of a link's target is affine in a
multiplier ``t_{l,h}`` on each head's output. The loading of head ``(l, h)`` on a link ``a -> b`` is
``weight(a -> b) - weight(a -> b with head (l, h)'s output removed)``; ``skip`` is the rest, the part that bypasses
layer ``l``'s attention through the residual stream, so each crossed layer's loadings and skip sum to the link's
weight. A head's output is ``W_o,h P_h V_kv(h)`` with any norm after the attention folded in (its share through the
frozen scale: :class:`~detjac.engine.Attention`); an affine family's value and output biases are constants, which a
link's weight (a derivative) does not see. Crossed layers: after ``a``'s MLP (from layer 0 for a token) up to ``b``'s
attention inclusive (the last layer for a logit); a neuron of the last layer linked to a logit crosses none.

How (docs/graphs.md, "Head loadings"): every path crosses layer ``l``'s attention once, through one head or the skip,
so ``loading_{l,h} = <g_l, W_o,h P_h V t_l>`` with ``t_l`` the source's write pushed up to layer ``l``'s input and
``g_l`` the target's cotangent at layer ``l``'s attention output, both in the cut model. The targets' cotangents come
from one cut pullback each (read at every crossed layer's output; with the MLP cut it is the next layer's attention
output's), kept for a block of targets that the memory budget holds; then the block's sources are pushed up once,
layer by layer, each layer resident once, and every link's loadings are read where its source and target meet."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from detjac.engine import (
    OUTPUT,
    Attention,
    Engine,
    PullRequest,
    Seed,
    Site,
    input_of,
)
from detjac.errors import InvalidArgumentError, UnsupportedModelError
from detjac.graph_nodes import LOGIT, NEURON, TOKEN
from detjac.graph_settings import first_crossed, last_crossed

from .prune import Pruned

HEAD_BLOCK_BYTES = 256 * 2**20  # cotangents kept for a block of targets, without a memory budget
SKIP = "skip"


@dataclass
class HeadLoadings:
    """The head loadings of a graph's strongest links.

    Attributes
    ----------
    links : numpy.ndarray
        (N, 2) each loaded link's (target, source) in the graph's adjacency, strongest ``|weight|`` first.
    loadings : numpy.ndarray
        (N, n_layers, heads + 1) each head's loading at each layer, the skip last; NaN at a layer the link does not
        cross.
    error : float
        The worst ``|sum over a layer's heads and skip - weight| / |weight|`` (0: exact).
    """

    links: np.ndarray
    loadings: np.ndarray
    error: float

    def of_link(self, k: int) -> dict[str, dict[str, float]]:
        """Link ``k``'s loadings as the JSON writes them: ``{"<layer>": {"<head>": w, ..., "skip": w}}``."""
        heads = self.loadings.shape[2] - 1
        out: dict[str, dict[str, float]] = {}
        for layer, row in enumerate(self.loadings[k]):
            if not np.isnan(row).all():
                out[str(layer)] = {**{str(h): float(row[h]) for h in range(heads)}, SKIP: float(row[heads])}
        return out


def carried_by_heads(loaded: HeadLoadings, target: int) -> tuple[int, np.ndarray]:
    """(links, (n_layers, heads + 1) summed loadings): what each head (and each layer's skip) carries of the loaded
    links into ``target`` (a row of the adjacency), summed over them."""
    into = loaded.links[:, 0] == target
    return int(into.sum()), np.nan_to_num(loaded.loadings[into]).sum(0)


def strongest_heads(loaded: HeadLoadings, adjacency: np.ndarray, target: int,
                    top: int = 5) -> tuple[int, float, list[tuple[int, int, float]]]:
    """(links, their weight, the ``top`` heads as (layer, head, summed loading), largest ``|loading|`` first): the
    heads that carry the most of the loaded links into ``target`` (:func:`carried_by_heads`; skips not ranked)."""
    links, sums = carried_by_heads(loaded, target)
    if not links:
        return 0, 0.0, []
    heads = sums[:, :-1]
    order = np.argsort(-np.abs(heads), axis=None)[:top]
    weight = float(adjacency[target, loaded.links[loaded.links[:, 0] == target][:, 1]].sum())
    return links, weight, [(int(i // heads.shape[1]), int(i % heads.shape[1]), float(heads.flat[i])) for i in order]




def loadable_links(adjacency: np.ndarray, pruned: Pruned, M: int, B: int, n: int, into: str = "all") -> np.ndarray:
    """(C, 2) the pruned graph's links (what its JSON shows) from a token or neuron to a neuron or logit (``into``
    ``logits``: to a logit), as (target, source), strongest ``|weight|`` first (ties in adjacency order)."""
    edges = pruned.edges & pruned.nodes[:, None] & pruned.nodes[None, :]
    targets, sources = np.nonzero(edges)
    keep = (sources < M) | ((sources >= M + B) & (sources < M + B + n))
    keep &= (targets >= M + B + n) if into == "logits" else (targets < M) | (targets >= M + B + n)
    targets, sources = targets[keep], sources[keep]
    order = np.argsort(-np.abs(adjacency[targets, sources]), kind="stable")
    return np.stack([targets[order], sources[order]], axis=1).astype(np.int64)


def choose_links(adjacency: np.ndarray, pruned: Pruned, M: int, B: int, n: int, heads: int, up_to: bool = False,
                 into: str = "all") -> np.ndarray:
    """The ``heads`` strongest of :func:`loadable_links` (``up_to``: all of them where there are fewer).

    Raises
    ------
    InvalidArgumentError
        More than the graph has, without ``up_to``.
    """
    links = loadable_links(adjacency, pruned, M, B, n, into)
    if heads > len(links) and not up_to:
        raise InvalidArgumentError(f"Expected --heads at most the pruned graph's {len(links)} links from a token or "
                                   f"neuron to a {'logit' if into == 'logits' else 'neuron or logit'} (bias nodes "
                                   f"carry no head loadings). Got {heads}.")
    return links[:heads]


@dataclass
class Nodes:
    """What the loadings need of the graph's nodes: the layout's sizes, each neuron's (layer, index, position) and
    value, its read and write rows (by layer, in the order of the layer's neurons), the logits' vectors, the
    embeddings."""

    M: int
    B: int
    n: int
    chosen: torch.Tensor  # (M, 3)
    values: torch.Tensor  # (M,)
    reads: dict[int, torch.Tensor]
    writes: dict[int, torch.Tensor]
    logit_vectors: torch.Tensor  # (K, d)
    embeddings: torch.Tensor  # (n, d)

    def row(self, c: int) -> tuple[int, int, int]:
        """Neuron ``c``'s (layer, position, rank among its layer's neurons)."""
        layer, pos = int(self.chosen[c, 0]), int(self.chosen[c, 2])
        return layer, pos, int((self.chosen[:c, 0] == layer).sum())

    def first(self, source: int) -> int:
        """The first layer a link from ``source`` (a neuron or a token) crosses (:func:`~detjac.graph_settings.
        first_crossed`)."""
        found = first_crossed(*((NEURON.name, int(self.chosen[source, 0])) if source < self.M else
                                (TOKEN.name, None)))
        assert found is not None  # a neuron or a token: bias nodes are never loaded (loadable_links)
        return found

    def top(self, target: int, n_layers: int) -> int:
        """The last layer a link into ``target`` (a neuron or a logit) crosses (:func:`~detjac.graph_settings.
        last_crossed`)."""
        found = last_crossed(*((NEURON.name, int(self.chosen[target, 0])) if target < self.M else (LOGIT.name, None)),
                             n_layers)
        assert found is not None
        return found

    def write(self, source: int) -> torch.Tensor:
        """(n, d) what ``source`` writes: a token's embedding, a neuron's value times its write row."""
        out = self.embeddings.new_zeros(self.embeddings.shape)
        if source >= self.M:
            p = source - self.M - self.B
            out[p] = self.embeddings[p]
            return out
        layer, pos, rank = self.row(source)
        out[pos] = self.values[source].to(out) * self.writes[layer][rank].to(out)
        return out


def head_loadings(engine: Engine, trace: Any, nodes: Nodes, links: np.ndarray, weights: np.ndarray,
                  held: int = 0) -> HeadLoadings:
    """The head loadings of ``links`` ((N, 2) (target, source) in the adjacency; ``weights`` (N,) their weights),
    see the module docstring. ``held``: bytes the graph holds beside (counted against a memory budget).

    Raises
    ------
    UnsupportedModelError
        A layer whose attention is not one block of heads (a post-norm layer).
    """
    L, n, d = engine.n_layers, nodes.n, engine.d_model
    heads = int(getattr(engine.config.get_text_config(), "num_attention_heads", 0))
    out = np.full((len(links), L, heads + 1), np.nan)
    if not len(links):
        return HeadLoadings(links, out, 0.0)
    by_target: dict[int, list[int]] = {}
    for k, (t, _) in enumerate(links.tolist()):
        by_target.setdefault(t, []).append(k)
    low = {t: min(nodes.first(int(links[k, 1])) for k in ks) for t, ks in by_target.items()}
    size = {t: max(0, nodes.top(t, L) + 1 - low[t]) * n * d * engine.dtype.itemsize for t in by_target}
    left, per_row = engine.sweep_memory(n)
    cap = HEAD_BLOCK_BYTES if left is None else max(0, left - held)
    block: list[int] = []
    for t in sorted(by_target, key=lambda t: -nodes.top(t, L)):
        if block and sum(size[b] + per_row for b in block) + size[t] + per_row > cap:
            _block(engine, trace, nodes, links, block, by_target, low, out)
            block = []
        block.append(t)
    _block(engine, trace, nodes, links, block, by_target, low, out)
    crossed = ~np.isnan(out[..., 0])
    sums = np.where(crossed, np.nan_to_num(out).sum(-1), weights[:, None])
    scale = np.maximum(np.abs(weights), np.finfo(np.float64).tiny)[:, None]
    return HeadLoadings(links, out, float((np.abs(sums - weights[:, None]) / scale).max()))


def _block(engine: Engine, trace: Any, nodes: Nodes, links: np.ndarray, block: Sequence[int],
           by_target: dict[int, list[int]], low: dict[int, int], out: np.ndarray) -> None:
    """The loadings of every link into ``block``'s targets: their cotangents pulled down once, kept; their sources
    pushed up once."""
    L = engine.n_layers
    cotangents = _cotangents(engine, trace, nodes, block, low)
    pairs = [(k, int(links[k, 1]), t) for t in block for k in by_target[t]]
    sources = sorted({s for _, s, _ in pairs})
    column = {s: i for i, s in enumerate(sources)}
    start = min(low[t] for t in block)
    top = max(nodes.top(t, L) for t in block)
    with engine.walk(trace) as walk, torch.no_grad():
        tangents = nodes.embeddings.new_zeros(len(sources), nodes.n, engine.d_model)
        for layer in range(start, top + 1):
            entering = [column[s] for s in sources if nodes.first(s) == layer]
            if entering:
                fresh = torch.stack([nodes.write(sources[i]) for i in entering])
                tangents[entering] = walk.enter(fresh) if layer == 0 else fresh
            here = [(k, column[s], t) for k, s, t in pairs if nodes.first(s) <= layer <= nodes.top(t, L)]
            with walk.layer(layer) as pull:
                attention = pull.attention()
                if not isinstance(attention, Attention):
                    raise UnsupportedModelError(f"Expected layer {layer}'s attention as one block of heads for head "
                                                f"loadings. Got {type(attention).__name__}.")
                mixed = attention.head_values(tangents)  # (S, heads, n, hd)
                if here:
                    wanted = sorted({t for _, _, t in here})
                    g = torch.stack([cotangents[t][layer] for t in wanted])  # (T, n, d)
                    u = attention.head_cotangents(g)  # (T, heads, n, hd)
                    row = {t: i for i, t in enumerate(wanted)}
                    for c0 in range(0, len(here), 64):
                        part = here[c0:c0 + 64]
                        ti = torch.tensor([row[t] for _, _, t in part])
                        si = torch.tensor([s for _, s, _ in part])
                        per_head = (u[ti] * mixed[si]).sum((-1, -2))  # (P, heads)
                        skip = (g[ti] * tangents[si]).sum((-1, -2))  # (P,)
                        ks = [k for k, _, _ in part]
                        out[ks, layer, :-1] = per_head.cpu().double().numpy()
                        out[ks, layer, -1] = skip.cpu().double().numpy()
                tangents += attention.heads_output(mixed)  # the MLP held: the layer's output is its mid residual
            del mixed, attention, pull  # they hold the layer's widened weights: not while the next one is widened


def _cotangents(engine: Engine, trace: Any, nodes: Nodes, block: Sequence[int], low: dict[int, int]
                ) -> dict[int, dict[int, torch.Tensor]]:
    """``{target: {layer: (n, d) the target's cotangent at the layer's attention output}}`` for every layer from
    ``low[target]`` to the target's top: one cut pullback per target, read at the outputs of the layers below its
    top (the MLPs held, a layer's output is the next layer's attention output's), a neuron's own read at its
    layer."""
    L, M, B, n = engine.n_layers, nodes.M, nodes.B, nodes.n
    kept: dict[int, dict[int, torch.Tensor]] = {t: {} for t in block}
    requests: list[PullRequest] = []
    owners: list[int] = []
    cut = frozenset({"mlp"})
    for t in block:
        top = nodes.top(t, L)
        if t < M:
            layer, pos, rank = nodes.row(t)
            read = nodes.reads[layer][rank]
            seed = read.new_zeros(1, n, read.shape[0])
            seed[0, pos] = read
            kept[t][layer] = seed[0]
            reads = tuple(input_of(below + 1) for below in range(low[t], layer))
            if reads:
                requests.append(PullRequest((Seed(Site("mid", layer), seed),), reads, cut))
                owners.append(t)
            continue
        vector = nodes.logit_vectors[t - M - B - n]
        reads = tuple(input_of(below + 1) for below in range(low[t], top + 1))
        if not reads:  # every link into it from a neuron of the last layer: none crosses a layer
            continue
        requests.append(PullRequest((Seed(OUTPUT, vector[None]),), reads, cut))
        owners.append(t)
    if requests:
        for j, site, g in engine.pulls(trace, requests):
            kept[owners[j]][site.layer - 1] = g[0]
    return kept
