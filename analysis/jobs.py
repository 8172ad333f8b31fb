"""Analyses mapped over a store's prompts, results written back next to the Jacobians.

A result already in the store with the same parameters is reused, so a job interrupted
half-way continues where it stopped. The dask scheduler in use (a ``distributed.Client``
when one is active, else dask's default) runs the array work.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .spectra import Spectrum, decode, dimensionality, singular_values, top_singular


def _name(kind: str, token: int | None) -> str:
    return f"{kind}_{'combined' if token is None else f'token{token}'}"


def svd(store: Any, prompt_ids: Iterable[str], k: int = 8, token: int | None = None, *, method: str = "randomized",
        power_iterations: int = 6, oversample: int = 10, seed: int = 0, progress: Any = None) -> list[Spectrum]:
    """Top-k triplets for each prompt (combined operator, or token ``token``), stored under ``analysis/``."""
    wanted = {"k": k, "method": method, "power_iterations": power_iterations, "oversample": oversample,
              "seed": seed}
    results = []
    for pid in prompt_ids:
        name = _name("svd", token)
        cached = store.read_analysis(pid, name)
        if cached is not None and cached[1].get("params") == wanted:
            arrays, attrs = cached
            results.append(Spectrum(pid, token, arrays["U"], arrays["S"], arrays["V"], method, attrs["params"]))
        else:
            spec = top_singular(store.get(pid), k, token, method=method, power_iterations=power_iterations,
                                oversample=oversample, seed=seed)
            store.write_analysis(pid, name, {"U": spec.U, "S": spec.S, "V": spec.V},
                                 {"params": wanted, "token": token})
            results.append(spec)
        if progress is not None:
            progress.update()
    return results


def decode_spectrum(store: Any, spec: Spectrum, top: int = 8) -> dict[str, Any]:
    """Decoded tokens of a spectrum's vectors: left through the unembedding, right through the embedding.

    For the combined operator each right vector is decoded at the token whose block carries
    most of its energy (reported with its share).
    """
    unembed, embed = store.model_array("unembedding"), store.model_array("embedding")
    left_ids, left_scores = decode(spec.U, unembed, top)
    if spec.token is None:
        energy = (spec.V**2).sum(axis=1)  # (n_tokens, k)
        where = energy.argmax(axis=0)  # (k,)
        right = spec.V[where, :, np.arange(spec.V.shape[-1])].T  # (cols, k)
        shares = energy[where, np.arange(len(where))] / energy.sum(axis=0)
    else:
        right, where, shares = spec.V, np.full(spec.V.shape[-1], spec.token), np.ones(spec.V.shape[-1])
    right_ids, right_scores = decode(right, embed, top)
    return {"left_ids": left_ids, "left_scores": left_scores, "right_ids": right_ids, "right_scores": right_scores,
            "right_tokens": where.tolist(), "right_shares": shares.tolist()}


def token_texts(store: Any) -> Any:
    """A function id -> text from the tokenizer kept in the store (ids as text without one)."""
    path = store.model_file("tokenizer.json")
    if path is None:
        return str
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return lambda i: repr(tok.decode([int(i)], skip_special_tokens=False))


def dims(store: Any, prompt_ids: Iterable[str], progress: Any = None) -> list[dict[str, Any]]:
    """Dimensionality (stable rank, participation ratio, n90, n99) per prompt: combined and per token."""
    rows = []
    for pid in prompt_ids:
        prompt = store.get(pid)
        for token in [None, *range(prompt.n_tokens)]:
            cached = store.read_analysis(pid, _name("spectrum", token))
            s = cached[0]["S"] if cached is not None else singular_values(prompt, token)
            if cached is None:
                store.write_analysis(pid, _name("spectrum", token), {"S": s}, {"token": token})
            d = dimensionality(s)
            rows.append({"prompt_id": pid, "token": "combined" if token is None else token,
                         "stable_rank": d.stable_rank, "participation_ratio": d.participation_ratio,
                         "n90": d.n90, "n99": d.n99, "sigma_1": float(s[0])})
        if progress is not None:
            progress.update()
    return rows


def to_csv(rows: list[dict[str, Any]], path: Any) -> None:
    """Rows of dicts as CSV (header from the first row)."""
    import csv

    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
