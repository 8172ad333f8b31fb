"""The attributions researchers use instead of an exact graph, on the unmodified model, beside detjac's own, for one
prompt's predicted token: every unit's predicted change of the target when it is ablated, and the actual change.

Units (:data:`UNIT_KINDS`) are MLP neurons ``(layer, position, index)``, the input of the layer's down projection,
and attention heads ``(layer, head)``, the head's slice of the input of the output projection at every position.
Targets (:data:`TARGETS`) are the predicted token's demeaned logit ``logit_t - mean_v logit_v`` and its
log-probability at the last position. A unit's value ``a`` is replaced by a baseline ``b`` (zero, or a mean over a
reference corpus: :func:`site_means`); every method predicts the change ``m(ablated) - m(clean)``:

- :func:`first_order` on the gradients of :func:`gradients`: ``(b - a) · ∂m/∂a``. With ``mode="real"`` (the
  unmodified model) it is attribution patching (AtP); with ``"detached"`` (attention probabilities, norm scales and
  gates frozen: :func:`detjac.engine.linearized`) it is detjac's total attribution, the graph's ranking pullback,
  exact for the detached model (with ``b = 0``, minus :func:`detjac.graphs.logit_attribution`); with ``"cut"``
  (detached, and every MLP's output held fixed) it is the direct effect, the graph's edge into the logit.
- :func:`integrated_gradients`: every unit of the kind (or one layer's, layer by layer) moved together along the
  straight path from the baseline to their values, the gradient averaged over ``steps`` midpoints; with
  ``mode="detached"``, detjac's attribution averaged along that path (the model detached at each point).
- :func:`ablate`: the ground truth, the unmodified model with each group of units set to the baseline (norms,
  softmaxes and gates recomputed), several groups per forward as a batch.

Scope: a pre-norm decoder whose layers hold ``mlp.down_proj`` and ``self_attn.o_proj`` (Llama, Gemma 3 and their
kin), refused by name otherwise. Forward hooks are put on the loaded model's own instances and removed on exit.
Definitions and results: docs/results/2026-11-28-attribution-vs-peers.md."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from detjac.engine.detach.model import linearized
from detjac.errors import InvalidArgumentError, UnsupportedModelError

UNIT_KINDS = ("neurons", "heads")
TARGETS = ("logit", "logprob")  # the demeaned logit of the predicted token, its log-probability
MODES = ("real", "detached", "cut")
Edit = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Sites:
    """Where one kind of unit lives: per layer the module whose input holds the units (``(B, n, width)``)."""

    kind: str
    modules: list[nn.Module]
    layers: list[nn.Module]  # the decoder layers (a batch is widened at one of them)
    downs: list[nn.Module]  # every MLP's down projection (held fixed by the cut)
    heads: int  # attention heads per layer (the width is heads x head_dim); 0 for neurons

    @property
    def n_layers(self) -> int:
        return len(self.modules)


def check_kind(kind: str) -> str:
    if kind not in UNIT_KINDS:
        raise InvalidArgumentError(f"Expected a unit kind among {', '.join(UNIT_KINDS)}. Got {kind!r}.")
    return kind


def unit_sites(model: nn.Module, kind: str) -> Sites:
    """The sites of ``kind`` in ``model`` (a Hugging Face causal LM).

    Raises
    ------
    InvalidArgumentError
        An unknown kind.
    UnsupportedModelError
        A model whose layers lack ``mlp.down_proj`` or ``self_attn.o_proj``.
    """
    check_kind(kind)
    layers = list(getattr(getattr(model, "model", None), "layers", []) or [])
    try:
        downs = [layer.mlp.down_proj for layer in layers]
        outs = [layer.self_attn.o_proj for layer in layers]
    except AttributeError:
        downs, outs = [], []
    if not layers or not downs:
        raise UnsupportedModelError(f"Expected a decoder whose layers hold mlp.down_proj and self_attn.o_proj. Got "
                                    f"{type(model).__name__}.")
    heads = int(model.config.get_text_config().num_attention_heads) if kind == "heads" else 0
    return Sites(kind, downs if kind == "neurons" else outs, layers, downs, heads)


def target_metrics(logits: torch.Tensor, token: int) -> torch.Tensor:
    """(B, V) logits at the predicted position -> (B, 2): the token's demeaned logit and log-probability."""
    return torch.stack([logits[:, token] - logits.mean(-1), torch.log_softmax(logits, -1)[:, token]], dim=1)


@contextmanager
def _hooked(sites: Sites, edits: dict[int, Edit], rows: int = 1, widen_at: int = 0, cut: bool = False
            ) -> Iterator[None]:
    """Run with ``edits[layer]`` applied to the input of that layer's site, the batch widened from 1 to ``rows`` at
    the input of layer ``widen_at`` (the layers below run once), and every MLP's down projection fed a detached input
    when ``cut``."""
    handles = []

    def widen(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0].expand(rows, *args[0].shape[1:]), *args[1:])

    def edit_of(layer: int) -> Callable[..., tuple[Any, ...]]:
        def hook(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            if cut and sites.kind == "neurons":
                x = x.detach()
            return (edits[layer](x) if layer in edits else x, *args[1:])
        return hook

    try:
        if rows > 1:
            handles.append(sites.layers[widen_at].register_forward_pre_hook(widen))
        for layer, module in enumerate(sites.modules):
            if layer in edits or cut and sites.kind == "neurons":
                handles.append(module.register_forward_pre_hook(edit_of(layer)))
        if cut and sites.kind == "heads":
            handles += [d.register_forward_pre_hook(lambda _m, args: (args[0].detach(), *args[1:]))
                        for d in sites.downs]
        yield
    finally:
        for h in handles:
            h.remove()


def _last_logits(model: nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """(B, V) the logits at the last position."""
    x = torch.tensor([list(ids)], device=next(model.parameters()).device)
    return model(input_ids=x, use_cache=False, logits_to_keep=1).logits[:, -1]


@dataclass
class Gradients:
    """One prompt's units of one kind on one model: ``acts[layer]`` (n, width) their values, ``grads[layer]`` (2, n,
    width) the gradient of each target (:data:`TARGETS`) at them, ``metrics`` (2,) the targets' values."""

    acts: list[torch.Tensor]
    grads: list[torch.Tensor]
    metrics: torch.Tensor


def gradients(model: nn.Module, ids: Sequence[int], token: int, kind: str, mode: str = "real") -> Gradients:
    """The gradients of the targets of ``token`` at every unit of ``kind``: of the unmodified model (``real``), the
    detached model (``detached``), or the detached model with every MLP's output held fixed (``cut``).

    Raises
    ------
    InvalidArgumentError
        An unknown kind or mode.
    """
    if mode not in MODES:
        raise InvalidArgumentError(f"Expected a mode among {', '.join(MODES)}. Got {mode!r}.")
    sites = unit_sites(model, kind)
    acts: dict[int, torch.Tensor] = {}
    leaves: dict[int, torch.Tensor] = {}

    def add_leaf(layer: int) -> Edit:
        def edit(x: torch.Tensor) -> torch.Tensor:  # x + 0 with a handle: the gradient at x, paths unchanged
            acts[layer] = x[0].detach()
            leaves[layer] = torch.zeros_like(x, requires_grad=True)
            return x + leaves[layer]
        return edit

    frozen = linearized(model) if mode != "real" else nullcontext()
    with frozen, torch.enable_grad(), _hooked(sites, {i: add_leaf(i) for i in range(sites.n_layers)},
                                              cut=mode == "cut"):
        m = target_metrics(_last_logits(model, ids), token)[0]  # (2,)
        order = list(range(sites.n_layers))
        rows = [torch.autograd.grad(m[j], [leaves[i] for i in order], retain_graph=j == 0, allow_unused=True)
                for j in range(2)]
    grads = [torch.stack([(r[i] if r[i] is not None else torch.zeros_like(leaves[i]))[0] for r in rows])
             for i in order]
    return Gradients([acts[i] for i in order], grads, m.detach())


def _per_unit(sites: Sites, per_element: list[torch.Tensor]) -> torch.Tensor:
    """[(T, n, width)] per layer -> (T, L, n, N) for neurons, (T, L, H) for heads (summed over positions and the
    head's dimensions)."""
    if sites.kind == "neurons":
        return torch.stack(per_element, dim=1)
    return torch.stack([e.reshape(*e.shape[:2], sites.heads, -1).sum(dim=(1, 3)) for e in per_element], dim=1)


def first_order(model: nn.Module, g: Gradients, kind: str, base: list[torch.Tensor]) -> torch.Tensor:
    """Each unit's predicted change of the targets when set to ``base`` (per layer (width,)): ``(b - a) · ∂m/∂a``,
    (2, L, n, N) for neurons, (2, L, H) for heads."""
    sites = unit_sites(model, kind)
    return _per_unit(sites, [gr * (b - a) for a, gr, b in zip(g.acts, g.grads, base, strict=True)])


def integrated_gradients(model: nn.Module, ids: Sequence[int], token: int, kind: str, base: list[torch.Tensor],
                         steps: int = 32, acts: list[torch.Tensor] | None = None, joint: bool = True,
                         mode: str = "real") -> torch.Tensor:
    """Each unit's integrated gradient on the unmodified model, as a predicted change when set to ``base``: minus
    ``(a - b) · mean_k ∂m/∂x (b + α_k (a - b))``, ``α_k = (k + 1/2) / steps`` (the midpoint rule). The path moves
    every unit of ``kind`` (every layer, every position) together when ``joint`` (one batch of ``steps`` rows), else
    one layer's units at a time (the other layers recomputed; ``n_layers`` batches). Completeness: the attributions
    of what moves together sum to ``m(moved to base) - m(clean)`` up to the midpoint rule's error ``max|f'''| / (24
    steps²)``, ``f(α)`` the target along the path (the rule integrates ``f'``). (2, L, n, N) for neurons, (2, L,
    H) for heads.

    ``mode="detached"``: detjac's attribution averaged along the same path, each point's gradient taken in the model
    detached *at that point* (attention probabilities, norm scales and gates frozen at their values there, each row
    of the batch its own): the first-order detached attribution re-linearized from the clean run to the baseline.
    Not complete (a detached gradient is not the gradient of ``m`` along the path); a predictor of the ablation."""
    if not isinstance(steps, int) or steps < 1:
        raise InvalidArgumentError(f"Expected a positive number of steps. Got {steps!r}.")
    if mode not in ("real", "detached"):
        raise InvalidArgumentError(f"Expected an integrated-gradients mode among real, detached. Got {mode!r}.")
    sites = unit_sites(model, kind)
    if acts is None:
        acts = gradients(model, ids, token, kind).acts
    alphas = (torch.arange(steps, dtype=acts[0].dtype, device=acts[0].device) + 0.5) / steps
    moves = [list(range(sites.n_layers))] if joint else [[layer] for layer in range(sites.n_layers)]
    out: dict[int, torch.Tensor] = {}
    for layers in moves:
        paths = {i: (base[i] + alphas[:, None, None] * (acts[i] - base[i])).requires_grad_(True) for i in layers}
        edits = {i: (lambda _x, path=paths[i]: path) for i in layers}  # (steps, n, width)
        frozen = linearized(model) if mode == "detached" else nullcontext()
        with frozen, torch.enable_grad(), _hooked(sites, edits, rows=steps, widen_at=layers[0]):
            m = target_metrics(_last_logits(model, ids), token)  # (steps, 2)
            g = [torch.autograd.grad(m[:, j].sum(), [paths[i] for i in layers], retain_graph=j == 0)
                 for j in range(2)]
        for k, i in enumerate(layers):
            out[i] = -torch.stack([g[0][k].mean(0), g[1][k].mean(0)]) * (acts[i] - base[i])
    return _per_unit(sites, [out[i] for i in range(sites.n_layers)])


def unit_count(model: nn.Module, kind: str, n_tokens: int) -> int:
    """How many units of ``kind`` a prompt of ``n_tokens`` has (the length of the flat unit index)."""
    sites = unit_sites(model, kind)
    if kind == "heads":
        return sites.n_layers * sites.heads
    return sites.n_layers * n_tokens * int(sites.modules[0].in_features)


def ablate(model: nn.Module, ids: Sequence[int], token: int, kind: str, groups: Sequence[Sequence[int]],
           base: list[torch.Tensor], batch: int = 32) -> np.ndarray:
    """The unmodified model's targets (G, 2) with each group of units (flat indices into (L, n, N) for neurons,
    (L, H) for heads) set to ``base``, ``batch`` groups per forward (widened at the lowest layer a chunk touches)."""
    sites = unit_sites(model, kind)
    n = len(ids)
    width = int(sites.modules[0].in_features)
    per_layer = sites.heads if kind == "heads" else n * width
    lowest = [min((int(u) // per_layer for u in g), default=sites.n_layers - 1) for g in groups]
    order = np.argsort(lowest, kind="stable")
    out = np.zeros((len(groups), 2))
    with torch.no_grad():
        for start in range(0, len(order), batch):
            chunk = order[start:start + batch]
            edits = _ablation_edits(sites, [groups[i] for i in chunk], base, per_layer, width)
            with _hooked(sites, edits, rows=len(chunk), widen_at=int(lowest[chunk[0]])):
                logits = _last_logits(model, ids)
            logits = logits.expand(len(chunk), -1)  # a chunk of empty groups never widened
            out[chunk] = target_metrics(logits, token).cpu().double().numpy()
    return out


def _ablation_edits(sites: Sites, groups: list[Sequence[int]], base: list[torch.Tensor], per_layer: int,
                    width: int) -> dict[int, Edit]:
    where: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for row, group in enumerate(groups):
        for u in group:
            layer, rest = divmod(int(u), per_layer)
            pos, index = divmod(rest, width) if sites.kind == "neurons" else (0, rest)
            spots = where.setdefault(layer, ([], [], []))
            spots[0].append(row)
            spots[1].append(pos)
            spots[2].append(index)
    edits: dict[int, Edit] = {}
    for layer, (rows, pos, idx) in where.items():
        r, q, i = (torch.tensor(v) for v in (rows, pos, idx))

        def edit(x: torch.Tensor, r: torch.Tensor = r, q: torch.Tensor = q, i: torch.Tensor = i,
                 b: torch.Tensor = base[layer]) -> torch.Tensor:
            x = x.expand(len(groups), *x.shape[1:]).clone()
            if sites.kind == "neurons":
                x[r, q, i] = b[i]
            else:
                view = x.view(*x.shape[:2], sites.heads, -1)  # (B, n, H, head_dim)
                view[r, :, i, :] = b.view(sites.heads, -1)[i][:, None, :]
            return x
        edits[layer] = edit
    return edits


def site_means(model: nn.Module, prompts: Sequence[Sequence[int]], kind: str) -> list[torch.Tensor]:
    """Each layer's (width,) mean input of the site of ``kind`` over every position of ``prompts`` (token ids): the
    mean-ablation baseline."""
    sites = unit_sites(model, kind)
    sums: dict[int, torch.Tensor] = {}
    count = 0

    def record(layer: int) -> Edit:
        def edit(x: torch.Tensor) -> torch.Tensor:
            s = x[0].sum(0)
            sums[layer] = sums[layer] + s if layer in sums else s
            return x
        return edit

    with torch.no_grad(), _hooked(sites, {i: record(i) for i in range(sites.n_layers)}):
        for ids in prompts:
            _last_logits(model, ids)
            count += len(ids)
    if not count:
        raise InvalidArgumentError("Expected at least one reference prompt for the means. Got none.")
    return [sums[i] / count for i in range(sites.n_layers)]
