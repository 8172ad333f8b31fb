"""Layerwise decomposition from the store: spectra, decoded tokens (through ``W_U diag(g)``, the final norm's gain)
and concept emergence per layer, the logit lens beside it. Definitions: docs/user-guide.md, "Layerwise
decomposition"."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidArgumentError, StoreError
from ..singular import orient
from ..targets import COMPONENTS, Target
from .spectra import dimensionality, operator_inputs, singular_values, stored_svd

if TYPE_CHECKING:
    from ..store import StoredPrompt, StoreReader


def lens(store: StoreReader, target: str | None = None) -> tuple[np.ndarray, bool]:
    """The matrix (vocab, d) in float64 that decodes a target's rows, and whether it holds the final norm's gain.

    Residual-stream targets (``layer``, ``attn``, ``mlp``, ``resid_mid`` and their ``_local``; the default) decode
    through ``W_U diag(g)``; targets already after the final norm (see
    :attr:`detjac.targets.Target.after_final_norm`: ``*_normed``, ``to_output``) through ``W_U`` alone.
    """
    unembed = store.model_array("unembedding").astype(np.float64)
    if target is not None and Target.parse(target).after_final_norm:
        return unembed, False
    try:
        gain = store.model_array("final_norm").astype(np.float64)
    except StoreError:
        return unembed, False
    return unembed * gain, True


def token_rank(scores: np.ndarray, token: int) -> int:
    """1-based rank of ``token`` among ``scores`` (vocab,), highest first; ties count in its favour."""
    return int((scores > scores[token]).sum()) + 1


def _targets(prompt: StoredPrompt, targets: Sequence[str] | None) -> list[str]:
    stored = prompt.layerwise_targets
    if not stored:
        raise InvalidArgumentError(f"Expected layerwise Jacobians with prompt {prompt.id}. Got none: run "
                                   "`detjac run MODEL PROMPTS --out STORE --layers all` to store them.")
    if targets is None:
        return stored
    missing = [t for t in targets if t not in stored]
    if missing:
        raise InvalidArgumentError(f"Expected layerwise targets of prompt {prompt.id} ({', '.join(stored)}). "
                                   f"Got {', '.join(missing)}.")
    return list(targets)


DENSE_BYTES = 256 * 2**20
"""A layerwise Jacobian up to this many float64 bytes is read once and decomposed in memory (numpy); larger ones
go through dask chunk by chunk."""


def _in_memory(prompt: StoredPrompt, target: str) -> np.ndarray | None:
    """The target's (rows, n, cols) Jacobian in float64 if it fits :data:`DENSE_BYTES`, read in one go; else None."""
    J = prompt.layerwise(target)  # lazy: only the shape is read here
    if J.size * 8 > DENSE_BYTES:
        return None
    return np.asarray(prompt.layerwise(target, lazy=False), dtype=np.float64)


def target_spectrum(store: StoreReader, prompt_id: str, target: str, k: int = 4) -> dict[str, np.ndarray]:
    """All singular values of a layerwise target's ``[J_1 ... J_n]`` and its top-``k`` triplets, kept in the store.

    Returns ``S_all`` (min(rows, n * cols),), ``U`` (rows, k), ``S`` (k,), ``V`` (n_tokens, cols, k).
    The top triplets come from the Gram matrix ``A A^T`` of ``A = [J_1 ... J_n]`` (the ``gram`` method of
    :func:`~detjac.analysis.spectra.stored_svd`). A Jacobian that fits :data:`DENSE_BYTES` is read once and every
    singular value comes from the same Gram matrix's eigenvalues: each energy ``sigma_i^2`` within
    ``eps * sigma_1^2``, which is all the dimensionality measures use (a value below ``~1e-7 sigma_1`` loses
    its relative accuracy). A larger one is streamed through dask, its values from an exact tall SVD.
    """
    name = f"layers_{target}"
    cached = store.analyses.read(prompt_id, name)
    if cached is not None and cached[1].get("params", {}).get("k") == k:
        return cached[0]
    prompt = store.get(prompt_id)
    dense = _in_memory(prompt, target)
    if dense is None:
        spec = stored_svd(prompt, k, None, method="gram", target=target)
        arrays = {"S_all": singular_values(prompt, None, target), "U": spec.U, "S": spec.S, "V": spec.V}
    else:
        arrays = _dense_spectrum(dense, k, prompt.layerwise(target, "output").astype(np.float64))
    store.analyses.write(prompt_id, name, arrays, {"params": {"k": k, "method": "gram"}, "target": target})
    return arrays


def _dense_spectrum(J: np.ndarray, k: int, produced: np.ndarray) -> dict[str, np.ndarray]:
    """What :func:`target_spectrum` returns, from the whole (rows, n, cols) Jacobian in memory; ``produced`` (rows,)
    is what it reconstructs (the sign of each pair: see :func:`detjac.singular.orient`)."""
    rows, n, cols = J.shape
    A = J.reshape(rows, n * cols)
    k = min(k, *A.shape)
    w, Q = np.linalg.eigh(A @ A.T)  # ascending energies sigma_i^2, each within eps * sigma_1^2
    s_all = np.sqrt(np.clip(w[::-1][:min(A.shape)], 0.0, None))
    U, S = Q[:, ::-1][:, :k], s_all[:k]
    V = (A.T @ U) / np.where(S > 0, S, 1.0)
    U, V = orient(U, V, produced)
    return {"S_all": s_all, "U": U, "S": S, "V": V.reshape(n, cols, k)}


def layer_table(store: StoreReader, prompt_ids: Iterable[str], *, k: int = 4, top: int = 10, token: int | None = None,
                targets: Sequence[str] | None = None, progress: Any = None) -> list[dict[str, Any]]:
    """One row per prompt and layerwise target: dimensionality and what ``u_1`` and the output decode to.

    ``token`` is the token id whose emergence is tracked (default: each prompt's predicted next
    token). Columns: ``sigma_1``, ``stable_rank``, ``participation_ratio``, ``n90``, ``n99``,
    ``u1_rank`` (rank of the token in the decoded ``u_1``; 1 = top), ``u1_hit`` (rank <= ``top``),
    ``first_sv`` (the first of the top ``k`` left singular vectors that has the token in its top
    ``top``, 0 if none), ``lens_rank`` (rank of the token when the output vector itself is
    decoded: the logit lens), ``u1_tokens`` (the top decoded token ids of ``u_1``) and ``normed`` (the target's
    rows are after the final norm, ``*_normed`` and ``to_output``, and decode through ``W_U``; else through
    ``W_U diag(g)``: see :func:`lens`).
    """
    rows = []
    for pid in prompt_ids:
        prompt = store.get(pid)
        tracked = int(prompt.attrs["next_token_id"]) if token is None else int(token)
        for target in _targets(prompt, targets):
            W, _ = lens(store, target)
            arrays = target_spectrum(store, pid, target, k)
            parsed = Target.parse(target)
            dims = dimensionality(arrays["S_all"])
            scores = W @ arrays["U"]  # (vocab, k)
            ranks = [token_rank(scores[:, i], tracked) for i in range(scores.shape[1])]
            lens_scores = W @ prompt.layerwise(target, "output").astype(np.float64)
            rows.append({
                "prompt_id": pid, "target": target, "layer": parsed.layer, "component": parsed.component,
                "local": parsed.local, "normed": parsed.after_final_norm,
                "token": tracked, "top": top, "sigma_1": float(arrays["S"][0]), "stable_rank": dims.stable_rank,
                "participation_ratio": dims.participation_ratio, "n90": dims.n90, "n99": dims.n99,
                "u1_rank": ranks[0], "u1_hit": ranks[0] <= top,
                "first_sv": next((i + 1 for i, r in enumerate(ranks) if r <= top), 0),
                "lens_rank": token_rank(lens_scores, tracked),
                "u1_tokens": np.argsort(-scores[:, 0], kind="stable")[:top].tolist(),
            })
        if progress is not None:
            progress.update()
    return rows


def targets_used(rows: Sequence[dict[str, Any]]) -> str:
    """Which targets a layer table used, normed or not, in words (one line)."""
    kinds = {}
    for r in rows:
        kinds.setdefault(bool(r["normed"]), set()).add(Target.parse(r["target"]).kind)
    parts = []
    if kinds.get(False):
        parts.append(f"{', '.join(sorted(kinds[False]))} (residual stream before the final norm, decoded through "
                     "W_U diag(g))")
    if kinds.get(True):
        parts.append(f"{', '.join(sorted(kinds[True]))} (after the final norm frozen at each vector's own value, "
                     "decoded through W_U)")
    return "targets: " + "; ".join(parts) if parts else "targets: none"


def emergence(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per prompt and cumulative component: the first layer whose ``u_1`` (and whose logit lens) has the token
    in its top decoded tokens; -1 when no stored layer does."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: r["layer"]):
        if r["local"]:
            continue
        entry = out.setdefault((r["prompt_id"], r["component"]), {
            "prompt_id": r["prompt_id"], "component": r["component"], "token": r["token"],
            "first_layer_u1": -1, "first_layer_lens": -1, "layers": 0})
        entry["layers"] += 1
        if r["u1_hit"] and entry["first_layer_u1"] < 0:
            entry["first_layer_u1"] = r["layer"]
        if r["lens_rank"] <= r["top"] and entry["first_layer_lens"] < 0:
            entry["first_layer_lens"] = r["layer"]
    return list(out.values())


def token_heatmap(store: StoreReader, prompt_id: str, component: str = "layer", *, token: int | None = None,
                  local: bool = False) -> dict[str, Any]:
    """Layer x input-token ranks of ``token`` (default: the predicted one), cached in the store.

    ``u1_rank[L, k]``: its rank in the decoded leading left singular vector of ``J_k`` of the
    target ``component.L``; ``contribution_rank[L, k]``: its rank in the decoded contribution
    ``J_k x_k`` of token k (what token k alone puts into that output). Rank 1 is the top token.
    """
    if component not in COMPONENTS:
        raise InvalidArgumentError(f"Expected a component among {', '.join(COMPONENTS)}. Got {component!r}.")
    prompt = store.get(prompt_id)
    picked = [t for t in map(Target.parse, _targets(prompt, None)) if t.component == component and t.local == local]
    kind = Target(0, component, local).kind  # mlp, mlp_local, ...
    if not picked:
        raise InvalidArgumentError(f"Expected stored {kind}.L targets with prompt {prompt_id}. "
                                   f"Got {', '.join(prompt.layerwise_targets)}.")
    return {**targets_heatmap(store, prompt_id, [t.name for t in sorted(picked)], token=token), "component": kind}


def targets_heatmap(store: StoreReader, prompt_id: str, targets: Sequence[str], *,
                    token: int | None = None) -> dict[str, Any]:
    """:func:`token_heatmap` over the stored layerwise ``targets`` given by name, one row each, in that order.

    Returns ``layers`` (each target's layer), ``token``, ``u1_rank`` and ``contribution_rank``
    (len(targets), n_tokens) and ``tokens`` (the prompt's token texts).
    """
    import dask.array as da

    prompt = store.get(prompt_id)
    targets = _targets(prompt, targets)
    tracked = int(prompt.attrs["next_token_id"]) if token is None else int(token)
    lenses = {after: lens(store, target)[0] for after, target in  # one decoding matrix per kind of target
              {Target.parse(t).after_final_norm: t for t in targets}.items()}
    u1_rank = np.zeros((len(targets), prompt.n_tokens), dtype=np.int64)
    contribution_rank = np.zeros_like(u1_rank)
    for i, target in enumerate(targets):
        W = lenses[Target.parse(target).after_final_norm]
        dense = _in_memory(prompt, target)
        J = dense if dense is not None else prompt.layerwise(target).astype(np.float64)  # (rows, n, cols)
        x = operator_inputs(prompt, target).astype(np.float64)  # (n, cols)
        contributions = (np.einsum("rtc,tc->tr", J, x) if dense is not None
                         else np.asarray(da.einsum("rtc,tc->tr", J, x).compute()))  # (n, rows)
        U1 = _per_token_u1(store, prompt, target, J, contributions)  # (n, rows)
        u1_rank[i] = [token_rank(col, tracked) for col in (W @ U1.T).T]
        contribution_rank[i] = [token_rank(col, tracked) for col in (W @ contributions.T).T]
    return {"layers": [Target.parse(t).layer for t in targets], "token": tracked, "u1_rank": u1_rank,
            "contribution_rank": contribution_rank,
            "tokens": list(prompt.attrs.get("tokens", [str(t) for t in prompt.array("token_ids")]))}


def _per_token_u1(store: StoreReader, prompt: StoredPrompt, target: str, J: Any,
                  contributions: np.ndarray) -> np.ndarray:
    """Leading left singular vector of each token's ``J_k`` of ``target`` (n, rows), kept in the store.

    ``J`` is the target's (rows, n, cols) Jacobian, in memory (numpy) or lazy (dask); each vector is signed so that
    ``u . (J_k x_k) >= 0`` with ``contributions`` (n, rows) the ``J_k x_k``.
    """
    name = f"layers_tokens_{target}"
    cached = store.analyses.read(prompt.id, name)
    if cached is not None:
        return cached[0]["U1"]
    if isinstance(J, np.ndarray):  # in memory: the top eigenvector of every J_k J_k^T, in one batched call
        method = "gram"
        per_token = J.transpose(1, 0, 2)  # (n, rows, cols)
        U1 = np.linalg.eigh(per_token @ per_token.transpose(0, 2, 1))[1][:, :, -1]  # (n, rows)
    else:
        method = "randomized"
        U1 = np.stack([stored_svd(prompt, 1, k, method=method, target=target).U[:, 0]
                       for k in range(prompt.n_tokens)])
    U1 *= np.where(np.einsum("tr,tr->t", U1, contributions) < 0, -1.0, 1.0)[:, None]
    store.analyses.write(prompt.id, name, {"U1": U1}, {"params": {"method": method}, "target": target})
    return U1
