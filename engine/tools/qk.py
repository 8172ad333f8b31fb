"""Exact QK attribution: why head ``h`` of layer ``L`` attends where it does at one query position.

The pre-softmax score ``s_ij`` (scaled, before the mask, before an attention soft-cap) is bilinear in the residual
stream at layer ``L``'s input at positions ``i`` and ``j`` once the norm scales (the input norm's at each position,
any q/k norm's) are frozen at their values on the prompt; that residual is the sum of exact components (``E``,
``B``, ``A{l}.{h}``, ``M{l}``, ``B{l}``: :mod:`detjac.engine.tools.qk_residual`). So the score splits into one term
per pair ``(Q, K)``, component ``Q`` at ``i`` against component ``K`` at ``j``, and the terms over every pair sum
to the score of the real model (float64 rounding), not of an approximation; an affine family's query and key
constants (its input norm's shift, its q/k biases) are the pair's side ``bias``.

Scope of exactness: every decoder family detjac detaches, on the in-memory engine (the whole model loaded). Each
call checks its own result (components against the layer's input, terms against the score its real query and key
give) and raises :class:`~detjac.errors.LinearizationError` where a float64 run is not exact. Definitions:
docs/graphs.md, "Why a head attends where it does"."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from detjac.errors import InvalidArgumentError, UnsupportedModelError
from detjac.exactness import check_exact, relative_error
from detjac.outputs import check_output, write_output  # files written aside, then renamed
from detjac.qk_sums import contrast_keys, contrast_sums
from detjac.tokens import token_texts

from ..detach.model import linearized
from ..inmemory.model_pieces import freeze_model
from ..inmemory.rows import prompt_position
from ..interface import Engine, Prompt
from ..pieces import NotAPiece
from .qk_path import Captured, QkPath, attention_child
from .qk_residual import Components, residual_components

__all__ = ["QKAttribution", "check_qk_request", "qk_attribution", "residual_decomposition"]

BIAS = "bias"  # the name of an affine family's query- or key-side constant
CHUNK = 32  # components run through the query and key path at a time


@dataclass
class QKAttribution:
    """The QK attribution of one head at one query position (see the module docstring).

    Attributes
    ----------
    layer, head, query_position : int
        What was attributed (the query position non-negative).
    token_ids, tokens : list
        The prompt (n) and each token's text.
    keys : list[dict]
        Per key position the mask allows, ascending: ``{"position": j, "score": s, "probability": p, "terms":
        [{"query": Q, "key": K, "value": v}, ...], "query_sums": [{"component": Q, "value": v}, ...],
        "key_sums": [...]}``, every pair listed, largest ``|v|`` first; ``score`` is the real model's (before the
        mask and the soft-cap), ``probability`` its attention weight. ``query_sums`` gives each query-side
        component's sum over every key-side component (its marginal), ``key_sums`` each key-side component's; each
        list adds up to the score, as the terms do.
    query_components : list[str]
        The components' names at the query position.
    residual_error : float
        Worst relative error of the components' sum against layer ``layer``'s input, over the query and keys.
    score_error : float
        Worst ``|sum of terms - score|`` over the keys, relative to the largest ``|score|``.
    info : dict
        The model's identity (family, model_type, name_or_path, dtype, n_layers, n_heads, d_model), the soft-cap,
        the scaling and the neurons asked for.
    """

    layer: int
    head: int
    query_position: int
    token_ids: list[int]
    tokens: list[str]
    keys: list[dict[str, Any]]
    query_components: list[str]
    residual_error: float
    score_error: float
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``detjac attention --out`` writes."""
        return {"layer": self.layer, "head": self.head, "query_position": self.query_position,
                "model": dict(self.info.get("model", {})), "token_ids": self.token_ids, "tokens": self.tokens,
                "query_token": self.tokens[self.query_position], "residual_error": self.residual_error,
                "score_error": self.score_error, **{k: v for k, v in self.info.items() if k != "model"},
                "keys": self.keys}

    def contrast(self, key: int | None = None, other: int | None = None) -> dict[str, Any]:
        """Why the head prefers key ``key`` to key ``other``: the difference of their scores split per query-side
        component and per key-side component (:mod:`detjac.qk_sums`), exactly.

        Parameters
        ----------
        key, other : int, optional
            Key positions the mask allows. Default: ``key`` the most attended, ``other`` the most attended of the
            rest (the next-most-attended).

        Returns
        -------
        dict
            ``key``, ``other``, ``difference`` (``score[key] - score[other]``), and ``query_sums`` and ``key_sums``
            (``[{"component": C, "value": v}, ...]``, largest ``|v|`` first): each component's marginal at ``key``
            minus at ``other`` (0 where it is not a component there); each list adds up to the difference.

        Raises
        ------
        InvalidArgumentError
            A position that is not an allowed key, the same position twice, or a query with one key only.
        """
        by = {k["position"]: k for k in self.keys}
        j, o = contrast_keys({p: k["probability"] for p, k in by.items()}, key, other)

        def side(name: str) -> list[dict[str, Any]]:
            pairs = contrast_sums(((s["component"], s["value"]) for s in by[j][name]),
                                  ((s["component"], s["value"]) for s in by[o][name]))
            return [{"component": c, "value": v} for c, v in pairs]

        return {"key": j, "other": o, "difference": by[j]["score"] - by[o]["score"],
                "query_sums": side("query_sums"), "key_sums": side("key_sums")}

    def write(self, out: str | Path, *, force: bool = False, model: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write the attribution's JSON (:meth:`to_dict`, ``model`` merged into its model identity) to ``out``
        (written aside, then renamed); return the JSON object. ``out`` is checked first
        (:func:`detjac.outputs.check_output`, an InvalidArgumentError naming why: not a ``.json`` path, an existing
        file without ``force``, a missing folder, inside a store or index)."""
        path = check_output(out, force=force, suffix=".json")
        data = self.to_dict()
        data["model"] = {**data["model"], **(model or {})}
        write_output(path, json.dumps(data))
        return data

    def __repr__(self) -> str:
        top = max(self.keys, key=lambda k: k["probability"])
        return (f"<QKAttribution layer {self.layer} head {self.head} at {self.query_position} "
                f"({self.tokens[self.query_position]!r}): {len(self.keys)} keys, most attended "
                f"{top['position']} ({self.tokens[top['position']]!r}, p={top['probability']:.3f}); "
                f"{len(self.query_components)} components, score error {self.score_error:.1e}>")


def qk_attribution(engine_or_model: Any, prompt: Prompt, layer: int, head: int, *, query: int | None = None,
                   neurons: int = 0, tokenizer: Any | None = None) -> QKAttribution:
    """The exact QK attribution of ``head`` of ``layer`` at position ``query`` (see the module docstring).

    Parameters
    ----------
    engine_or_model
        An in-memory engine (:func:`~detjac.engine.load_engine`) or a loaded transformers causal LM.
    prompt
        Text or token ids.
    layer, head
        The attention layer (0-based, ``0 <= layer < n_layers``) and its query head (``0 <= head < n_heads``).
    query
        The query position (negative: from the end); default the last.
    neurons
        0: each MLP is one component ``M{l}``. K > 0: each ``M{l}`` is split, at each position, into its K neurons
        that write the most there (``|z| · |w|``, named ``M{l}.{i}``) and ``M{l}.rest``; still exact.
    tokenizer
        For a model given without an engine, its tokenizer (text prompts).

    Returns
    -------
    QKAttribution

    Raises
    ------
    UnsupportedModelError
        A family without a QK attribution (an encoder: BERT), before any work; or a model the engine's pieces do not
        cover.
    InvalidArgumentError
        A layer or head out of range, a negative ``neurons`` or more than an MLP has, a query position outside the
        prompt, or a layer-streamed engine.
    PromptError
        An empty prompt, unknown token ids, or more tokens than the model's context.
    LinearizationError
        A float64 result that is not exact (a bug: please report the model).
    """
    model, tokenizer = _model_of(engine_or_model, tokenizer)
    check_qk_request(model.config, layer, head, neurons)
    ids, position = prompt_position(model, prompt, query, tokenizer)
    with _traced(model, ids, layer, neurons) as (lin, comps, inputs, call):
        dtype = str(inputs[0].dtype).removeprefix("torch.")
        residual_error = relative_error(comps.total(), inputs[layer])
        check_exact(residual_error, dtype, what="the residual components", family=lin.family.name)
        path = QkPath(call[0], attention_child(call[0], lin.family), call[1], call[2])
        real = path.record(inputs[layer])
        q, k, names = _projected(path, comps, lin.family.affine)
    i = position % len(ids)
    keys, score_error = _keys(real, q, k, names, head, i)
    check_exact(score_error, dtype, what="the QK terms", family=lin.family.name)
    cfg = model.config.get_text_config()
    info = {"model": {"family": lin.family.name, "model_type": model.config.model_type,
                      "name_or_path": getattr(model.config, "_name_or_path", "") or "", "dtype": dtype,
                      "n_layers": int(cfg.num_hidden_layers), "n_heads": int(cfg.num_attention_heads),
                      "d_model": int(cfg.hidden_size)},
            "scaling": real.scaling, "softcap": real.softcap, "neurons": neurons}
    texts = token_texts(tokenizer, ids) or [f"<{t}>" for t in ids]
    return QKAttribution(layer, head, i, list(ids), texts, keys, [n[i] for n in names[0]], residual_error,
                         score_error, info)


def residual_decomposition(engine_or_model: Any, prompt: Prompt, layer: int, *, neurons: int = 0,
                           tokenizer: Any | None = None) -> tuple[Components, torch.Tensor]:
    """Layer ``layer``'s input as :func:`qk_attribution` splits it: its components (names and vectors (C, n, d),
    at every position) and the input itself (n, d), as the prompt's pass computed it.

    Raises
    ------
    UnsupportedModelError, InvalidArgumentError, PromptError
        As :func:`qk_attribution`.
    """
    model, tokenizer = _model_of(engine_or_model, tokenizer)
    check_qk_request(model.config, layer, 0, neurons)
    ids, _ = prompt_position(model, prompt, None, tokenizer)
    with _traced(model, ids, layer, neurons) as (_, comps, inputs, _):
        return comps, inputs[layer]


@contextmanager
def _traced(model: Any, ids: list[int], layer: int, neurons: int) -> Iterator[tuple[Any, Components, Any, Any]]:
    """Inside the linearized model: (it, the components of layer ``layer``'s input, each layer's real input up to
    it, that layer's call)."""
    with linearized(model, detach=True) as lin:
        x = lin.decoder.get_input_embeddings()(torch.tensor([ids], device=model.device))[0].detach()  # (n, d)
        frozen, inputs, call = _forward(lin, x, layer)
        yield lin, residual_components(frozen, inputs, x, layer, neurons), inputs, call


def check_qk_request(config: Any, layer: int, head: int, neurons: int) -> None:
    """Refuse, before any work, what :func:`qk_attribution` cannot do for a model of ``config``.

    Raises
    ------
    UnsupportedModelError
        A family without a QK attribution (an unknown one, or an encoder).
    InvalidArgumentError
        A layer or head out of range, or a negative ``neurons``.
    """
    from ..families import family_for

    family = family_for(config)
    if family.encoder or family.post_norm:
        raise UnsupportedModelError(
            f"Expected a causal decoder family for a QK attribution (a query reads the keys before it through a "
            f"causal mask). Got {family.name}: a bidirectional encoder with post-norm layers.")
    cfg = config.get_text_config()
    for name, value, count, what in (("layer", layer, cfg.num_hidden_layers, "layers"),
                                     ("head", head, cfg.num_attention_heads, "query heads per layer")):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < count:
            raise InvalidArgumentError(f"Expected a {name} in [0, {count - 1}] (the model has {count} {what}). "
                                       f"Got {value!r}.")
    if not isinstance(neurons, int) or isinstance(neurons, bool) or neurons < 0:
        raise InvalidArgumentError(f"Expected neurons to be a non-negative integer. Got {neurons!r}.")


def _model_of(engine_or_model: Any, tokenizer: Any | None) -> tuple[Any, Any | None]:
    if isinstance(engine_or_model, Engine):
        if any(p.device.type == "meta" for p in engine_or_model.model.parameters()):
            raise InvalidArgumentError(f"Expected an in-memory engine (the whole model loaded) for a QK attribution. "
                                       f"Got a {type(engine_or_model).__name__}, whose layers are read one at a time.")
        return engine_or_model.model, tokenizer if tokenizer is not None else engine_or_model.tokenizer
    return engine_or_model, tokenizer


def _forward(lin: Any, x: torch.Tensor, layer: int) -> tuple[Any, list[torch.Tensor], tuple[Any, ...]]:
    """The prompt's pass: the frozen pieces, each layer's real input (n, d) and layer ``layer``'s call (module,
    args after the hidden states, kwargs)."""
    layers = list(lin.family.layers(lin.decoder))
    calls: dict[int, tuple[Any, ...]] = {}

    def keep(index: int) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            calls.setdefault(index, (module, hidden[0].detach(), args[1:], rest))
        return hook

    handles = [m.register_forward_pre_hook(keep(j), with_kwargs=True) for j, m in enumerate(layers[:layer + 1])]
    try:
        frozen, _, _ = freeze_model(lin, x, x.shape[0] - 1)
    except NotAPiece as e:
        raise UnsupportedModelError(f"Expected a {lin.family.name} model made of detjac's known pieces for a QK "
                                    f"attribution. Got one that is not: {e}.") from None
    finally:
        for h in handles:
            h.remove()
    module, _, args, kwargs = calls[layer]
    return frozen, [calls[j][1] for j in range(layer + 1)], (module, args, kwargs)


def _projected(path: QkPath, comps: Components, affine: bool
               ) -> tuple[torch.Tensor, torch.Tensor, list[list[list[str]]]]:
    """Each component's query (C', heads, n, hd) and key (C', kv_heads, n, hd) and the names on each side; an affine
    family's constants (the path on zeros) are one more component, ``bias``, on each side."""
    vectors, names = comps.vectors, comps.names
    zero = path.run(torch.zeros_like(vectors[:1])) if affine else None
    qs, ks = [], []
    for start in range(0, vectors.shape[0], CHUNK):
        got = path.run(vectors[start:start + CHUNK])
        qs.append(got.query if zero is None else got.query - zero.query)
        ks.append(got.key if zero is None else got.key - zero.key)
    if zero is not None:
        qs.append(zero.query)
        ks.append(zero.key)
        names = names + [[BIAS] * vectors.shape[1]]
    return torch.cat(qs), torch.cat(ks), [names, names]


def _keys(real: Captured, q: torch.Tensor, k: torch.Tensor, names: list[list[list[str]]], head: int, i: int
          ) -> tuple[list[dict[str, Any]], float]:
    """Per allowed key: the real score and probability and every pair's term; the worst relative error of the terms'
    sums against the real scores."""
    groups = real.query.shape[1] // real.key.shape[1]
    kv = head // groups
    scores = (real.query[0, head, i] @ real.key[0, kv].T) * real.scaling  # (n,): before the mask and the cap
    capped = scores if real.softcap is None else torch.tanh(scores / real.softcap) * real.softcap
    mask = real.mask[0, 0, i, : scores.shape[0]] if real.mask is not None else torch.zeros_like(scores)
    allowed = (mask > torch.finfo(mask.dtype).min / 2).nonzero()[:, 0]
    probs = torch.softmax(capped + mask.to(capped.dtype), dim=-1)
    terms = torch.einsum("qe,kje->jqk", q[:, head, i], k[:, kv, allowed]) * real.scaling  # (keys, C, C)
    sums = terms.sum((1, 2))
    scale = float(scores[allowed].abs().max().clamp_min(torch.finfo(scores.dtype).tiny))
    error = float((sums - scores[allowed]).abs().max()) / scale
    q_names, k_names = names
    out = []
    for a, j in enumerate(allowed.tolist()):
        flat = terms[a].reshape(-1)
        order = flat.abs().argsort(descending=True).tolist()
        c = terms.shape[2]
        out.append({"position": j, "score": float(scores[j]), "probability": float(probs[j]),
                    "query_sums": _side_sums(terms[a].sum(1), [n[i] for n in q_names]),
                    "key_sums": _side_sums(terms[a].sum(0), [n[j] for n in k_names]),
                    "terms": [{"query": q_names[o // c][i], "key": k_names[o % c][j], "value": float(flat[o])}
                              for o in order]})
    return out, error


def _side_sums(values: torch.Tensor, names: list[str]) -> list[dict[str, Any]]:
    """Each component's sum over every component of the other side, largest ``|value|`` first: one side's exact
    split of the score (the values add up to it)."""
    order = values.abs().argsort(descending=True).tolist()
    return [{"component": names[o], "value": float(values[o])} for o in order]
