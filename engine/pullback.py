"""The one pullback primitive: cotangents seeded anywhere in a detached model, swept down, read off anywhere.

A :class:`PullRequest` says where cotangents enter (:class:`Seed`: the output, a layer's input, mid residual,
attention or MLP output, or an MLP's neurons), where rows are read off (:class:`Site`: a layer's input, an MLP's
neurons, the input embeddings) and what is held fixed (``cut``: every MLP's output). :func:`pulls` runs any batch of
requests top-down through a :class:`Walk`, which each engine implements (in memory: the frozen pieces of the whole
model; layer-streamed: one layer at a time). Details: docs/engine.md, "The pullback primitive"."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from detjac.errors import InvalidArgumentError

# where cotangents may enter, where rows may be read off, and what may be held fixed
SEED_KINDS = ("output", "every_position", "input", "mid", "attn", "mlp", "neurons")
READ_KINDS = ("input", "neurons", "embeddings")
CUTS = ("mlp",)


@dataclass(frozen=True, order=True)
class Site:
    """A place in the model: ``kind`` (:data:`SEED_KINDS`, :data:`READ_KINDS`) at decoder layer ``layer``.

    ``input`` at layer ``l`` is layer ``l``'s input (``l = n_layers``: the last layer's output, the final norm's
    input); ``mid`` its residual between attention and MLP; ``attn`` / ``mlp`` the attention's / MLP's output (a
    branch of the residual stream); ``neurons`` the MLP's neurons (their values ``z``, see
    :class:`~detjac.engine.pieces.layer.Mlp`); ``output`` the final normed state at the target position,
    ``every_position`` at every position; ``embeddings`` the input embeddings (layer -1)."""

    kind: str
    layer: int = -1

    @property
    def name(self) -> str:
        return self.kind if self.layer < 0 else f"{self.kind}.{self.layer}"


OUTPUT = Site("output")
EVERY_POSITION = Site("every_position")
EMBEDDINGS = Site("embeddings")


def input_of(layer: int) -> Site:
    return Site("input", layer)


def neurons_of(layer: int) -> Site:
    return Site("neurons", layer)


@dataclass(frozen=True)
class Seed:
    """Cotangents entering at ``site``: (B, d) for ``output``; (B, n, ffn) for ``neurons``; (B, n, d) elsewhere."""

    site: Site
    values: torch.Tensor


@dataclass(frozen=True)
class PullRequest:
    """One batch of B rows: seeds (each with B rows), the sites whose cotangents are read, and what is cut.

    ``d_model`` is needed only when every seed is at neurons (it sizes the residual stream's cotangents)."""

    seeds: tuple[Seed, ...]
    reads: tuple[Site, ...]
    cut: frozenset[str] = field(default_factory=frozenset)
    d_model: int | None = None

    @property
    def rows(self) -> int:
        return int(self.seeds[0].values.shape[0])

    @property
    def top(self) -> int:
        """The layer at whose output the sweep must hold this request's rows first (the last layer for the output;
        ``l - 1`` for a seed at layer ``l``'s input; ``l`` for one inside layer ``l``)."""
        return max(_entry(s.site) for s in self.seeds)

    @property
    def bottom(self) -> int:
        """The lowest layer whose input is read (-1: the embeddings): after it the request leaves the sweep."""
        return min(-1 if r.kind == "embeddings" else r.layer for r in self.reads)


def _entry(site: Site) -> int:
    if site.kind in ("output", "every_position"):
        return 2**31
    return site.layer - 1 if site.kind == "input" else site.layer


class LayerPull(Protocol):
    """One decoder layer as the sweep crosses it (what a :class:`Walk` hands out)."""

    input: torch.Tensor | None  # (n, d) the layer's input on the prompt (None: a walk that does not keep it)

    def pull(self, g_out: torch.Tensor, g_mid: torch.Tensor | None, s: int, cut: bool) -> tuple[torch.Tensor, int]:
        """(B, n, d) at the layer's output and mid residual, zero before ``s`` -> (B, n, d) at its input, start."""

    def neuron_cotangents(self, g_out: torch.Tensor) -> torch.Tensor:
        """(B, n, d) at the layer's output (= its MLP's output) -> (B, n, n_neurons) at the MLP's neurons."""

    def neuron_seeds(self, g: torch.Tensor) -> torch.Tensor:
        """(B, n, n_neurons) at the MLP's neurons -> (B, n, d) at the mid residual."""

    def activations(self) -> torch.Tensor:
        """(n, n_neurons) the MLP's neurons on the prompt."""

    def mlp(self) -> Any:
        """The MLP's explicit piece (its neurons' ``read_rows``, ``write_rows`` and ``output``)."""

    def attention(self) -> Any:
        """The attention's explicit piece (:class:`~detjac.engine.pieces.layer.Attention`: head by head,
        :meth:`~detjac.engine.pieces.layer.Attention.head_values`)."""


class Walk(Protocol):
    """What :func:`pulls` needs of an engine: its final norm, its layers one at a time, what comes before them."""

    n_layers: int
    n_tokens: int

    def supports(self, request: PullRequest) -> str | None:
        """None, or why this walk cannot honour ``request`` (checked before anything is computed)."""

    def final(self, seed: Seed) -> torch.Tensor:
        """An ``output`` or ``every_position`` seed -> (B, n, d) cotangents at the last layer's output."""

    def layer(self, i: int) -> AbstractContextManager[LayerPull]:
        """Layer ``i``, resident for the duration of the block."""

    def embed(self, g: torch.Tensor) -> torch.Tensor:
        """(B, n, d) at layer 0's input -> at the input embeddings (the norms before the first layer)."""

    def enter(self, t: torch.Tensor) -> torch.Tensor:
        """(B, n, d) tangents at the input embeddings -> at layer 0's input (:meth:`embed` transposed)."""

    def residual_ends(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, d) each: the residual stream on the prompt entering the first layer and leaving the last (what an
        affine family's constants before and after the layers are read against)."""

    def push(self, tangents: torch.Tensor) -> torch.Tensor:
        """``J v`` of the output: (c, n, d) tangents at the input embeddings -> (c, d) (:func:`detjac.engine.sweeps.
        push`)."""


def neuron_activations(walk: Walk, layers: Sequence[int]) -> Iterator[tuple[int, torch.Tensor, Any]]:
    """``(layer, (n, n_neurons) its neurons' values, its MLP piece)`` for each of ``layers``, one layer resident at a
    time."""
    for i in layers:
        with walk.layer(i) as layer:
            yield i, layer.activations(), layer.mlp()
        del layer  # its pieces hold the layer's widened weights: not while the next one is widened


def check_pull(requests: Sequence[PullRequest], have: frozenset[str], detach: bool) -> None:
    """Refuse, by name and before any work, requests an engine cannot honour: ``have`` is its
    :attr:`~detjac.engine.Engine.pullback_sites`, ``detach`` whether its Jacobian is detached (which says why).

    Raises
    ------
    InvalidArgumentError
        The sites or cut it lacks, and why.
    """
    wanted = {s.site.kind for r in requests for s in r.seeds} | {x.kind for r in requests for x in r.reads} | {
        f"cut:{c}" for r in requests for c in r.cut}
    missing = sorted(wanted - have)
    if missing:
        why = "the Jacobian is not detached" if not detach else "the autograd sweeps were chosen"
        raise InvalidArgumentError(f"Expected pull requests this engine honours ({', '.join(sorted(have))}). Got "
                                   f"{', '.join(missing)}, which it cannot: {why}.")


def check_request(request: PullRequest, n_layers: int, n_tokens: int) -> None:
    """Refuse a malformed request by name (sites unknown or out of range, rows that disagree, no reads).

    Raises
    ------
    InvalidArgumentError
        What was expected and what was got.
    """
    if not request.seeds or not request.reads:
        raise InvalidArgumentError(f"Expected a pull request with seeds and reads. Got {len(request.seeds)} seeds "
                                   f"and {len(request.reads)} reads.")
    bad_cut = sorted(set(request.cut) - set(CUTS))
    if bad_cut:
        raise InvalidArgumentError(f"Expected cuts among {', '.join(CUTS)}. Got {', '.join(bad_cut)}.")
    for seed in request.seeds:
        _check_site(seed.site, SEED_KINDS, "seed", n_layers)
        if seed.values.shape[0] != request.rows:
            raise InvalidArgumentError(f"Expected every seed with {request.rows} rows. Got {seed.values.shape[0]} "
                                       f"at {seed.site.name}.")
        want = 2 if seed.site == OUTPUT else 3
        if seed.values.dim() != want or (want == 3 and seed.values.shape[1] != n_tokens):
            raise InvalidArgumentError(f"Expected a seed at {seed.site.name} of {want} dimensions "
                                       f"{'(rows, d)' if want == 2 else f'(rows, {n_tokens}, ...)'}. "
                                       f"Got {tuple(seed.values.shape)}.")
    if all(s.site.kind == "neurons" for s in request.seeds) and request.d_model is None:
        raise InvalidArgumentError("Expected d_model on a pull request whose seeds are all at neurons. Got None.")
    for site in request.reads:
        _check_site(site, READ_KINDS, "read", n_layers)
        if site.kind == "neurons" and site.layer > request.top or site.kind == "input" and site.layer > request.top + 1:
            raise InvalidArgumentError(f"Expected reads below the highest seed. Got {site.name}.")


def _check_site(site: Site, kinds: Sequence[str], what: str, n_layers: int) -> None:
    if site.kind not in kinds:
        raise InvalidArgumentError(f"Expected a {what} site among {', '.join(kinds)}. Got {site.kind!r}.")
    if site.kind in ("output", "every_position", "embeddings"):
        return
    low = 1 if site.kind == "input" and what == "seed" else 0  # a seed at layer 0's input would enter below it
    top = n_layers if site.kind == "input" else n_layers - 1
    if not low <= site.layer <= top:
        raise InvalidArgumentError(f"Expected a {what} at a layer in [{low}, {top}] for {site.kind}. Got "
                                   f"{site.layer}.")


def pulls(walk: Walk, requests: Sequence[PullRequest]) -> Iterator[tuple[int, Site, torch.Tensor]]:
    """``(request index, site, cotangents)`` for every read of every request, as the sweep reaches it (so a caller
    can store or reduce each and let it go): (B, n, d) at a layer's input or the embeddings, (B, n, n_neurons) at
    an MLP's neurons.

    The requests' rows cross each layer together (one layer resident serves them all); a request joins at its
    highest seed and leaves after its lowest read.

    Raises
    ------
    InvalidArgumentError
        A malformed request, one the walk cannot honour (a cut or neurons where a layer has no explicit pieces),
        or requests with different cuts.
    """
    for request in requests:  # what the walk cannot honour is said first: the autograd walk has no layers to check
        problem = walk.supports(request)
        if problem is not None:
            raise InvalidArgumentError(f"Expected a pull request this engine can honour. Got one it cannot: {problem}.")
        check_request(request, walk.n_layers, walk.n_tokens)
    cuts = {r.cut for r in requests}
    if len(cuts) > 1:
        raise InvalidArgumentError(f"Expected one cut for requests swept together. Got {len(cuts)}.")
    cut = "mlp" in next(iter(cuts), frozenset())
    n = walk.n_tokens
    active: dict[int, torch.Tensor | None] = {}  # request -> its cotangents (B, n, d) at the current layer's output
    for j, request in enumerate(requests):
        for seed in request.seeds:
            if seed.site.kind in ("output", "every_position"):
                g = walk.final(seed)
                prev = active.get(j)
                active[j] = g if prev is None else prev + g
    for i in range(walk.n_layers - 1, -1, -1):
        for j, request in enumerate(requests):
            if request.top == i:
                active.setdefault(j, None)
        for j in list(active):
            active[j] = _seeded(active[j], requests[j], input_of(i + 1))
            if input_of(i + 1) in requests[j].reads:
                yield j, input_of(i + 1), _or_zeros(active[j], requests[j], n)
            if requests[j].bottom == i + 1:  # nothing left to read below
                del active[j]
        if not active:
            continue
        order = list(active)
        sizes = [requests[j].rows for j in order]
        read: list[tuple[int, Site, torch.Tensor]] = []
        with walk.layer(i) as layer:
            g_out = torch.cat([_or_zeros(active[j], requests[j], n) for j in order])
            _add_mlp_seeds(g_out, requests, order, i)  # an MLP-output seed enters at the output, leaves at the mid
            if any(neurons_of(i) in requests[j].reads for j in order):  # the MLP output's cotangents, through W_down
                for j, part in zip(order, layer.neuron_cotangents(g_out).split(sizes), strict=True):
                    if neurons_of(i) in requests[j].reads:
                        read.append((j, neurons_of(i), part))
            g_mid, own_attn = _mid_seeds(requests, order, i, layer)
            s = _first_nonzero_position(g_out, g_mid)
            g_in, _ = layer.pull(g_out, g_mid, s if s < n else 0, cut)
        del g_out, g_mid, layer  # the layer's pieces hold its widened weights: not while the next one is widened
        yield from read
        del read
        for j, part in zip(order, g_in.split(sizes), strict=True):
            if j in own_attn:
                part = part - own_attn[j]  # attn = mid - input: the identity path leaves
            active[j] = part
        del g_in
    for j in list(active):  # layer 0's input
        if input_of(0) in requests[j].reads:
            yield j, input_of(0), _or_zeros(active[j], requests[j], n)
        if requests[j].bottom == 0:
            del active[j]
    for j, g in active.items():
        if EMBEDDINGS in requests[j].reads:
            yield j, EMBEDDINGS, walk.embed(_or_zeros(g, requests[j], n))


def _add_mlp_seeds(g_out: torch.Tensor, requests: Sequence[PullRequest], order: list[int], i: int) -> None:
    offset = 0
    for j in order:
        seed = _seed_at(requests[j], Site("mlp", i))
        if seed is not None:
            g_out[offset:offset + requests[j].rows] += seed
        offset += requests[j].rows


def _zeros(request: PullRequest, n: int) -> torch.Tensor:
    """(B, n, d) zeros like the request's seeds."""
    v = request.seeds[0].values
    wide = [s.values for s in request.seeds if s.site.kind != "neurons"]
    return v.new_zeros(request.rows, n, wide[0].shape[-1] if wide else int(request.d_model or 0))


def _or_zeros(g: torch.Tensor | None, request: PullRequest, n: int) -> torch.Tensor:
    return g if g is not None else _zeros(request, n)


def _seed_at(request: PullRequest, site: Site) -> torch.Tensor | None:
    found = [s.values for s in request.seeds if s.site == site]
    if not found:
        return None
    return found[0] if len(found) == 1 else torch.stack(found).sum(0)


def _seeded(g: torch.Tensor | None, request: PullRequest, site: Site) -> torch.Tensor | None:
    """``g`` plus any seed ``request`` has at ``site`` (a layer's input, i.e. the layer below's output)."""
    seed = _seed_at(request, site)
    if seed is None:
        return g
    return seed.clone() if g is None else g + seed


def _mid_seeds(requests: Sequence[PullRequest], order: list[int], i: int, layer: LayerPull
               ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
    """The stacked cotangents entering at layer ``i``'s mid residual (mid, attention and MLP outputs, neurons), and
    each request's attention-output seed (to take off after the layer: it does not cross the identity path)."""
    parts: list[torch.Tensor | None] = []
    own_attn: dict[int, torch.Tensor] = {}
    for j in order:
        r = requests[j]
        total: torch.Tensor | None = None
        for kind in ("mid", "attn"):
            seed = _seed_at(r, Site(kind, i))
            if seed is not None:
                total = seed.clone() if total is None else total + seed
                if kind == "attn":
                    own_attn[j] = seed
        mlp_seed = _seed_at(r, Site("mlp", i))
        if mlp_seed is not None:  # mlp = output - mid
            total = -mlp_seed if total is None else total - mlp_seed
        neuron_seed = _seed_at(r, neurons_of(i))
        if neuron_seed is not None:
            back = layer.neuron_seeds(neuron_seed)
            total = back if total is None else total + back
        parts.append(total)
    if all(p is None for p in parts):
        return None, own_attn
    like = next(p for p in parts if p is not None)
    return torch.cat([p if p is not None else like.new_zeros(requests[j].rows, *like.shape[1:])
                      for j, p in zip(order, parts, strict=True)]), own_attn


def _first_nonzero_position(*cotangents: torch.Tensor | None) -> int:
    """The first position (axis 1) where any of ``cotangents`` (B, n, d) is nonzero; n if none is."""
    used = torch.stack([g.ne(0).any(dim=2).any(dim=0) for g in cotangents if g is not None]).any(dim=0)
    hits = used.nonzero()
    return int(hits[0]) if hits.numel() else int(used.shape[0])
