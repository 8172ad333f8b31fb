"""Neuron indexes made by hand for tests: one resealed with other identity keys or arrays (as a hostile user, or
another tool, could write it: the seal matches, the content lies), and an empty one of any model's shape."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from detjac.store import NeuronStats, commit_index, read_sealed, start_index, write_sealed
from detjac.store.neuron_index import DIMS, GROUP


def resealed(index: Path, dest: Path, identity: dict[str, Any] | None = None,
             arrays: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of the index at ``index`` at ``dest``, its sealed group rewritten with ``identity`` keys and
    ``arrays`` replaced, and sealed again."""
    shutil.copytree(index, dest)
    found, attrs = read_sealed(dest / GROUP, "a test's neuron index")
    attrs["identity"].update(identity or {})
    attrs.pop("written_at", None)
    write_sealed(dest, GROUP, {**found, **(arrays or {})}, attrs, "reseal a test's neuron index", DIMS)
    return dest


def empty_index(path: Path, n_layers: int, per_layer: int, **identity: Any) -> Path:
    """A complete index of one two-token prompt counting no position, for a model of ``n_layers`` layers of
    ``per_layer`` neurons (``identity`` adds or replaces keys, e.g. ``weights_sha256``)."""
    ident = {"weights_sha256": None, "family": "Llama", "model_type": "llama", "n_layers": n_layers,
             "dtype": "float64", "convention": None, "k": 1, "shard_prompts": 1, "corpus_sha256": "0" * 64,
             "prompts": 1, "neurons_per_layer": per_layer, **identity}
    start_index(path, ident)
    corpus = {"prompt_tokens": np.array([1, 2]), "prompt_offsets": np.array([0, 2]), "prompt_line": np.array([1]),
              "vocab_ids": np.array([1, 2]), "vocab_utf8": np.frombuffer(b"ab", dtype=np.uint8),
              "vocab_offsets": np.array([0, 1, 2])}
    final = {"write_ids": np.full((n_layers, per_layer, 2, 1), -1), "write_values": np.full((n_layers, per_layer, 2, 1),
                                                                                             np.nan)}
    commit_index(path, ident, NeuronStats.empty(n_layers, per_layer, 1), corpus, [0], final)
    return path
