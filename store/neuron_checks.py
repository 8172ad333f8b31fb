"""What a neuron index's sealed group must hold to be read (:mod:`detjac.store.neuron_index`): its identity (model
shape, corpus size, K, shard layout) agrees with its arrays' shapes, and every index it stores (a context's prompt and
position, a prompt's or a token text's offsets, the shards counted) lies inside what it indexes. A seal proves the
files are those written; these checks make a resealed or hand-made index that disagrees with itself raise
:class:`~detjac.store.integrity.CorruptError` instead of reading back as other tokens, an ``IndexError`` or Python's
negative indexing. Nothing here imports torch."""

from __future__ import annotations

from typing import Any

import numpy as np

from .integrity import CorruptError
from .neuron_stats import EDGES, N_BINS

HINT = "Re-run `detjac neurons` with --force-new."
# identity keys that size the arrays: each a positive integer
SIZES = ("n_layers", "neurons_per_layer", "k", "prompts", "shard_prompts")
INTEGERS = ("top_prompt", "top_position", "histogram", "n_positive", "n_negative", "prompt_tokens", "prompt_offsets",
            "prompt_line", "vocab_ids", "vocab_offsets", "write_ids")


def check_index(what: str, attrs: dict[str, Any], arrays: dict[str, np.ndarray] | None) -> None:
    """Raise CorruptError unless the sealed group's ``attrs`` (``identity``, ``shards``, ``complete``, ``n_tokens``)
    and ``arrays`` (None: the attributes only) agree (see the module docstring). ``what`` names the index."""
    try:
        _check(attrs, arrays)
    except CorruptError as exc:
        raise CorruptError(f"Expected an intact {what}. Got a damaged one: {exc}. {HINT}") from None


def _check(attrs: dict[str, Any], arrays: dict[str, np.ndarray] | None) -> None:
    identity = attrs.get("identity")
    if not isinstance(identity, dict):
        raise CorruptError(f"its identity is {identity!r}, not an object")
    bad = [key for key in SIZES if not _count(identity.get(key)) or identity[key] < 1]
    if bad:
        said = ", ".join(f"{k} {identity.get(k)!r}" for k in bad)
        raise CorruptError(f"identity {said} (expected positive integers)")
    n_shards = -(-identity["prompts"] // identity["shard_prompts"])
    shards, n_tokens = attrs.get("shards"), attrs.get("n_tokens")
    if not isinstance(shards, list) or not all(_count(s) and s < n_shards for s in shards) or \
            shards != sorted(set(shards)) or (attrs.get("complete") is True and len(shards) != n_shards):
        raise CorruptError(f"shards {shards!r}, not shards of 0..{n_shards - 1} in order"
                           + (" (all of them, as the index is complete)" if attrs.get("complete") else ""))
    if not _count(n_tokens):
        raise CorruptError(f"n_tokens {n_tokens!r}")
    if arrays is not None:
        _check_shapes(identity, bool(attrs.get("complete")), arrays)
        _check_ranges(identity, n_tokens, arrays)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_shapes(identity: dict[str, Any], complete: bool, arrays: dict[str, np.ndarray]) -> None:
    L, M, K, P = (identity[key] for key in ("n_layers", "neurons_per_layer", "k", "prompts"))
    top = (L, M, 2, K)
    want: dict[str, tuple[int, ...] | None] = {
        "top_value": top, "top_prompt": top, "top_position": top, "histogram": (L, M, N_BINS), "n_positive": (L, M),
        "n_negative": (L, M), "sum": (L, M), "sum_squares": (L, M), "edges": EDGES.shape, "prompt_tokens": None,
        "prompt_offsets": (P + 1,), "prompt_line": (P,)}
    if complete:
        n_vocab = arrays["vocab_ids"].shape if "vocab_ids" in arrays else (0,)
        want.update({"vocab_ids": None, "vocab_utf8": None, "vocab_offsets": (n_vocab[0] + 1,), "write_ids": None,
                     "write_values": None})
    for name, shape in want.items():
        if name not in arrays:
            raise CorruptError(f"no array {name}")
        got = arrays[name]
        if shape is not None and got.shape != shape:
            raise CorruptError(f"{name} of shape {got.shape} where its identity (n_layers {L}, neurons_per_layer {M}, "
                               f"k {K}, prompts {P}) says {shape}")
        if name in INTEGERS and got.dtype.kind not in "iu":
            raise CorruptError(f"{name} of dtype {got.dtype}, not integers")
    if complete:
        for name in ("write_ids", "write_values"):
            if arrays[name].ndim != 4 or arrays[name].shape[:3] != (L, M, 2):
                raise CorruptError(f"{name} of shape {arrays[name].shape}, not ({L}, {M}, 2, ...)")
        if arrays["vocab_utf8"].dtype != np.uint8 or arrays["vocab_ids"].ndim != 1:
            raise CorruptError("vocab_utf8 not bytes or vocab_ids not a list")


def _check_ranges(identity: dict[str, Any], n_tokens: int, arrays: dict[str, np.ndarray]) -> None:
    _check_offsets("prompt_offsets", arrays["prompt_offsets"], arrays["prompt_tokens"].size)
    if "vocab_offsets" in arrays:
        _check_offsets("vocab_offsets", arrays["vocab_offsets"], arrays["vocab_utf8"].size)
    prompt, position = arrays["top_prompt"], arrays["top_position"]
    empty = prompt == -1
    if not np.array_equal(empty, position == -1):
        raise CorruptError("top_prompt and top_position not empty (-1) in the same slots")
    n_prompts = identity["prompts"]
    if ((prompt < -1) | (prompt >= n_prompts)).any():
        raise CorruptError(f"top_prompt {_outside(prompt, -1, n_prompts)} outside -1..{n_prompts - 1}")
    lengths = np.diff(arrays["prompt_offsets"])
    limit = np.where(empty, 0, lengths[np.where(empty, 0, prompt)])  # each slot's prompt's length
    if ((position < 0) & ~empty).any() or (position >= limit)[~empty].any():
        bad = ((position < 0) | (position >= limit)) & ~empty
        raise CorruptError(f"top_position {int(position[bad][0])} outside its prompt "
                           f"{int(prompt[bad][0])} (of {int(limit[bad][0])} tokens)")
    if (arrays["prompt_line"] < 1).any():
        raise CorruptError(f"prompt_line {int(arrays['prompt_line'].min())}, not a line number")
    if not (arrays["histogram"].sum(axis=-1) == n_tokens).all():
        raise CorruptError(f"histograms that do not each count its n_tokens ({n_tokens}) positions")


def _check_offsets(name: str, offsets: np.ndarray, size: int) -> None:
    """Offsets into ``size`` items: from 0, never decreasing, ending at ``size``."""
    if offsets.ndim != 1 or offsets.size == 0 or offsets[0] != 0 or offsets[-1] != size or \
            (np.diff(offsets) < 0).any():
        raise CorruptError(f"{name} that are not offsets into its {size} items (from 0, increasing, to {size}): "
                           f"{offsets[:4].tolist()}{' ...' if offsets.size > 4 else ''}")


def _outside(values: np.ndarray, low: int, high: int) -> int:
    return int(values[(values < low) | (values >= high)][0])
