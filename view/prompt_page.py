"""The prompt page: tokens, prediction, reconstruction errors, spectra, decoded singular triplets, stored analyses.

Every number comes from :mod:`detjac.analysis` run on a :class:`~detjac.view.readonly.ReadOnlyStore`, with
``detjac analyze``'s defaults (:data:`SVD_K`, :data:`SVD_TOP`, :data:`SVD_POWER`); a result ``detjac analyze``
kept in the store is shown instead of being computed again, and says so; a low-rank prompt shows its stored
triplets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..analysis import (
    Spectrum,
    cached_spectrum,
    decode_spectrum,
    dimensionality,
    low_rank_spectrum,
    piece_reader,
    prompt_svds,
    read_spectrum,
    read_svd,
)
from ..errors import DetjacError
from ..singular import decode_top
from ..sinks import sink_note
from .graph_page import stored_graph
from .jsonable import jsonable

if TYPE_CHECKING:
    from ..store import StoredPrompt
    from .readonly import ReadOnlyStore

SVD_K, SVD_TOP, SVD_POWER = 5, 8, 6  # `detjac analyze svd`'s defaults: --k, --top, --power-iterations
PREDICTION_TOP = 10  # most probable next tokens listed
SPECTRUM_SHOWN = 512  # singular values sent per operator (the largest)


def kind_of(target: str) -> str:
    """The kind of a layerwise target name: ``mlp_local`` for ``mlp_local.3`` (whatever kinds a store holds)."""
    return target.rpartition(".")[0]


def layer_kinds(prompt: StoredPrompt) -> list[str]:
    """The kinds of the prompt's layerwise targets, in the store's order."""
    return list(dict.fromkeys(kind_of(t) for t in prompt.layerwise_targets))


def token_pieces(view: ReadOnlyStore, prompt: StoredPrompt) -> list[str]:
    """The prompt's tokens as the run decoded them (their ids as text when the run had no tokenizer)."""
    pieces = prompt.attrs.get("tokens")
    return list(pieces) if pieces else [str(t) for t in prompt.array("token_ids").tolist()]


def spectrum(view: ReadOnlyStore, prompt: StoredPrompt, token: int | None) -> tuple[np.ndarray, str]:
    """All singular values of ``J_token`` (``None``: of ``[J_1 ... J_n]``) and where they come from."""
    if prompt.low_rank:
        return prompt.triplets(token)[1], f"stored triplets (rank {prompt.attrs.get('rank')})"
    stored = read_spectrum(view.stored, prompt.id, token, n_tokens=prompt.n_tokens)
    if stored is not None:
        return stored, "kept in the store (detjac analyze dims)"
    return cached_spectrum(view, prompt, token), "computed (as detjac analyze dims)"


def _spectrum_entry(S: np.ndarray) -> dict[str, Any]:
    d = dimensionality(S)
    S = np.asarray(S, dtype=np.float64)
    return {"S": S[:SPECTRUM_SHOWN], "count": int(S.shape[0]), "sigma_1": float(S[0]) if S.size else 0.0,
            "frobenius": float(np.sqrt((S**2).sum())), "stable_rank": d.stable_rank,
            "participation_ratio": d.participation_ratio, "n90": d.n90, "n99": d.n99}


def prediction(view: ReadOnlyStore, prompt: StoredPrompt) -> dict[str, Any]:
    """The most probable next tokens, ``softmax(W_U y)`` of the stored output ``y`` and unembedding ``W_U``."""
    W = view.model_array("unembedding")  # (vocab, row)
    y = prompt.array("output").astype(np.float64)  # (row,)
    ids, logits = decode_top(y[:, None], W, PREDICTION_TOP)  # (1, top) each
    full = np.asarray(W, dtype=np.float64) @ y  # (vocab,)
    peak = full.max()
    log_total = peak + np.log(np.exp(full - peak).sum())
    text = piece_reader(view)
    top = [{"id": int(t), "text": text(int(t)), "logit": float(s), "p": float(np.exp(s - log_total))}
           for t, s in zip(ids[0], logits[0], strict=True)]
    return {"top": top, "how": "softmax(W_U y): the stored output y through the stored unembedding W_U"}


def _guarded(compute: Any) -> dict[str, Any]:
    """``compute()``, or ``{"error": message}`` for a store that cannot give it (no model matrices, ...)."""
    try:
        return compute()
    except DetjacError as exc:
        return {"error": str(exc)}


def analyses(view: ReadOnlyStore, prompt_id: str) -> list[dict[str, Any]]:
    """The results ``detjac analyze`` kept in the store for this prompt: name, parameters, array shapes, values."""
    out = []
    for name in view.stored.names(prompt_id):
        found = view.stored.read(prompt_id, name)
        if found is None:
            continue
        arrays, attrs = found
        entry = {"name": name, "attrs": attrs, "arrays": {k: list(v.shape) for k, v in arrays.items()}}
        if "S" in arrays:
            entry["S"] = np.asarray(arrays["S"]).reshape(-1)[:16]
        out.append(entry)
    return out


def prompt_payload(view: ReadOnlyStore, prompt_id: str) -> dict[str, Any]:
    """Everything the prompt page shows before an operator is picked (see the module docstring)."""
    prompt = view.get(prompt_id)
    a = prompt.attrs

    def entry(token: int | None) -> dict[str, Any]:
        S, source = spectrum(view, prompt, token)
        return {**_spectrum_entry(S), "source": source}

    combined = _guarded(lambda: entry(None))
    tokens = [_guarded(lambda k=k: entry(k)) for k in range(prompt.n_tokens)]
    layerwise_errors = {t: info.get("reconstruction_error") for t, info in (a.get("layerwise") or {}).items()}
    return jsonable({
        "id": prompt.id, "text": a.get("prompt", ""), "line": a.get("line"), "meta": a.get("meta"),
        "tokens": token_pieces(view, prompt), "token_ids": prompt.array("token_ids"), "n_tokens": prompt.n_tokens,
        "next_token": a.get("next_token"), "next_token_id": a.get("next_token_id"),
        "detached": a.get("detached", True), "dtype": a.get("dtype"), "storage_dtype": a.get("storage_dtype"),
        "model_id": a.get("model_id"), "low_rank": prompt.low_rank, "rank": a.get("rank"),
        "affine": bool(a.get("affine")), "written_at": a.get("written_at"),
        "errors": {"output": a.get("reconstruction_error"), "layerwise": layerwise_errors},
        "prediction": _guarded(lambda: prediction(view, prompt)),
        "spectra": {"combined": combined, "tokens": tokens},
        "kinds": layer_kinds(prompt), "analyses": analyses(view, prompt.id),
        "graph": stored_graph(prompt) is not None})


def _triplets(view: ReadOnlyStore, prompt: StoredPrompt, token: int | None) -> tuple[Spectrum, str]:
    """The operator's top triplets: stored ones when the store keeps them, else ``detjac analyze svd``'s."""
    if prompt.low_rank:
        return (low_rank_spectrum(prompt, int(prompt.triplets(token)[1].shape[0]), token),
                f"stored triplets of the low-rank run (rank {prompt.attrs.get('rank')})")
    stored = read_svd(view.stored, prompt.id, token, n_tokens=prompt.n_tokens)
    if stored is not None:
        return stored, f"kept in the store by detjac analyze svd ({_describe(stored.params)})"
    spec = prompt_svds(view, [prompt.id], SVD_K, token, method="randomized", power_iterations=SVD_POWER)[0]
    how = "an exact SVD (a small operator)" if spec.method == "exact" else _describe(spec.params)
    return spec, f"computed now with detjac analyze svd's defaults ({how}); not written to the store"


def _describe(params: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in params.items())


def operator_payload(view: ReadOnlyStore, prompt_id: str, token: int | None) -> dict[str, Any]:
    """The top singular triplets of ``J_token`` (``None``: ``[J_1 ... J_n]``), decoded to tokens as
    ``detjac analyze svd`` decodes them (left through the unembedding, right through the embedding), with
    each right vector's share of energy per input token."""
    prompt = view.get(prompt_id)
    spec, source = _triplets(view, prompt, token)
    ids = decode_spectrum(view, spec, SVD_TOP)
    text = piece_reader(view)
    if token is None:
        energy = (np.asarray(spec.V, dtype=np.float64) ** 2).sum(axis=1)  # (n_tokens, k)
        shares = energy / np.where(energy.sum(axis=0) > 0, energy.sum(axis=0), 1.0)
    else:
        shares = np.zeros((prompt.n_tokens, len(spec.S)))
        shares[token] = 1.0
    triplets = [{"index": i + 1, "sigma": float(sigma),
                 "left": [text(t) for t in ids["left_ids"][i]], "right": [text(t) for t in ids["right_ids"][i]],
                 "right_token": int(ids["right_tokens"][i]) % prompt.n_tokens,
                 "right_share": float(ids["right_shares"][i]), "token_shares": shares[:, i],
                 "sink": sink_note(int(ids["right_tokens"][i]) % prompt.n_tokens, float(ids["right_shares"][i]),
                                   combined=token is None)}
                for i, sigma in enumerate(spec.S)]
    return jsonable({"id": prompt.id, "token": token, "source": source, "method": spec.method,
                     "top": SVD_TOP, "triplets": triplets})
