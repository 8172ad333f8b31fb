"""Synthetic prompts written through the store's public API as a real run writes them (``runs/batch.py``), and
:func:`make_store`, a whole synthetic store (see :mod:`detjac.store.testing`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ... import __version__
from ...exactness import relative_error
from ...targets import Target
from .. import JacobianStore, LayerwiseSpec, SubspaceIteration, create_store, open_store, storage_dtype
from .model import (
    LOW_RANK_PASSES,
    PromptTruth,
    SyntheticModel,
    _through,
    factory_rank,
    prompt_texts,
    run_description,
    synthetic_model,
    synthetic_prompt,
)


@dataclass
class SyntheticStore:
    """A store written by :func:`make_store` and what it was written from."""

    path: Path
    run: dict[str, Any]
    model: SyntheticModel
    prompts: dict[str, PromptTruth]  # by prompt id, in the order written

    def open(self) -> JacobianStore:
        return open_store(self.path)

    @property
    def ids(self) -> list[str]:
        return sorted(self.prompts)


def write_prompt(store: JacobianStore, model: SyntheticModel, run: dict[str, Any], truth: PromptTruth, *,
                 line: int = 1, token_block: int = 1, graph: dict[str, Any] | None = None) -> float:
    """Write one prompt as a real run does (``runs/batch.py:write_prompt``); returns its stored reconstruction error.

    Every Jacobian goes in blocks (``write_block``): row blocks in reverse mode, ``token_block``
    tokens at a time in forward mode (the run's ``mode``, for runs with layerwise targets);
    ``keep`` of ``rank:K`` stores triplets from the store's subspace iteration instead; ``graph`` (a graph JSON
    object) is kept as the prompt's attribution graph, as a ``--graph`` run keeps it.
    """
    storage = storage_dtype(run["dtype"])
    rank = factory_rank(run["keep"])
    row_block, d, n = run["row_block"], model.d_model, truth.n_tokens
    J, x, y = (a.astype(storage) for a in (truth.jacobian, truth.embeddings, truth.output))
    bias = truth.bias.astype(storage) if truth.bias is not None else None
    error = _error(J, x, y, bias)
    mode = run.get("mode", "reverse")
    specs = {name: _spec(name, mode, token_block) for name in truth.layerwise}
    extra: dict[str, Any] = {}
    with store.begin(truth.id, n_rows=d, n_tokens=n, n_cols=d, dtype=storage, row_block=row_block, rank=rank,
                     layerwise=specs or None, graph=graph is not None) as writer:
        if graph is not None:
            writer.write_graph(graph)
        if rank is not None:
            extra = _write_low_rank(writer, J, rank, row_block, run.get("passes", LOW_RANK_PASSES))
        else:
            _write_blocks(writer, "jacobian", J, mode if specs else "reverse", row_block, token_block)
        if specs:  # the streamed engine: every target block by block, and what its blocks were
            extra = _write_layerwise(writer, truth, specs, storage, row_block, token_block, x)
            extra["stream"] = {"row_block": row_block, "token_block": token_block, "bytes_read": 0}
        writer.write_array("embeddings", x)
        writer.write_array("output", y)
        writer.write_array("token_ids", np.asarray(truth.token_ids, dtype=np.int64))
        if bias is not None:
            writer.write_array("bias", bias)
            extra["affine"] = True
        writer.commit({**_prompt_attrs(model, run, truth, line, error, storage), **extra})
    return error


def _spec(name: str, mode: str, token_block: int) -> LayerwiseSpec:
    t = Target.parse(name)
    return LayerwiseSpec(t.layer, t.component, t.local, mode, token_block)


def _error(J: np.ndarray, x: np.ndarray, y: np.ndarray, bias: np.ndarray | None = None) -> float:
    """The reconstruction error of the stored values, as ``detjac store verify`` recomputes it."""
    recon = _through(J.astype(np.float64), x.astype(np.float64))
    if bias is not None:
        recon += bias.astype(np.float64)
    return relative_error(recon, y.astype(np.float64))


def _write_blocks(writer: Any, target: str, J: np.ndarray, mode: str, row_block: int, token_block: int) -> None:
    d, n = J.shape[:2]
    if mode == "forward":  # token blocks of every row
        for k in range(0, n, token_block):
            writer.write_block(target, 0, d, k, min(k + token_block, n), J[:, k:k + token_block])
    else:
        for start in range(0, d, row_block):
            stop = min(start + row_block, d)
            writer.write_block(target, start, stop, 0, n, J[start:stop])


def _write_layerwise(writer: Any, truth: PromptTruth, specs: dict[str, LayerwiseSpec], storage: str,
                     row_block: int, token_block: int, x: np.ndarray) -> dict[str, Any]:
    layerwise = {}
    for name, spec in specs.items():
        t = truth.layerwise[name]
        J, y = t.jacobian.astype(storage), t.output.astype(storage)
        _write_blocks(writer, name, J, spec.mode, row_block, token_block)
        writer.write_layerwise(name, "output", y)
        inputs = x
        if t.inputs is not None:
            inputs = t.inputs.astype(storage)
            writer.write_layerwise(name, Target.parse(name).source_array or "inputs", inputs)
        layerwise[name] = {"reconstruction_error": _error(J, inputs, y), "mode": spec.mode}
    return {"layerwise": layerwise}


def _write_low_rank(writer: Any, J: np.ndarray, rank: int, row_block: int, passes: int) -> dict[str, Any]:
    d, n, cols = J.shape
    iteration = SubspaceIteration(d, n, cols, rank, passes=passes)
    more = True
    while more:
        for start in range(0, d, row_block):
            stop = min(start + row_block, d)
            iteration.update(start, stop, J[start:stop].astype(np.float64))
        more = iteration.end_pass()
    return {**writer.write_triplets(*iteration.finish()), "passes": passes}


def _prompt_attrs(model: SyntheticModel, run: dict[str, Any], truth: PromptTruth, line: int, error: float,
                  storage: str) -> dict[str, Any]:
    """As ``runs/batch.py:_prompt_attrs``."""
    from ..format import now

    words = model.words
    return {"prompt": truth.text, "line": line, "meta": {}, "n_tokens": truth.n_tokens, "token_ids": truth.token_ids,
            "tokens": [words[i] for i in truth.token_ids], "reconstruction_error": error,
            "next_token_id": truth.next_token_id, "next_token": words[truth.next_token_id],
            "detached": run["detach"], "dtype": run["dtype"], "storage_dtype": storage, "model_id": run["model_id"],
            "revision": run["revision"], "model_type": run["model_type"], "position": run["position"],
            "detach_rules": run["detach_rules"], "detjac_version": __version__, "written_at": now()}


def make_store(path: str | Path, *, prompts: int | Sequence[str] = 2, d_model: int = 8, n_tokens: int = 4,
               vocab: int = 40, n_layers: int = 2, targets: Sequence[str] = (), keep: str = "full",
               affine: bool = False, detach: bool = True, dtype: str = "float64", row_block: int = 3,
               mode: str = "reverse", token_block: int = 1, final_norm: bool = True, tokenizer: bool = True,
               seed: int = 0, model: SyntheticModel | None = None,
               graphs: Callable[[PromptTruth], dict[str, Any]] | None = None) -> SyntheticStore:
    """Create a store at ``path`` and write ``prompts`` (a count, or texts of words) into it; see the module docstring.

    ``targets`` names layerwise Jacobians (``layer.1``, ``mlp_local.0``, ...; negative layers count
    from the end) stored with every prompt; ``keep="rank:K"`` stores triplets (no layerwise
    targets); ``affine`` adds an offset ``b``; ``detach=False`` writes an ordinary run's
    Jacobians. ``model`` reuses another store's model (two runs of the same model). ``graphs`` gives each prompt's
    attribution graph (e.g. :func:`synthetic_graph`), stored with it as a ``--graph`` run stores it.
    """
    model = model or synthetic_model(d_model, vocab, seed=seed, final_norm=final_norm, tokenizer=tokenizer)
    names = [Target.parse(t, n_layers).name for t in targets]
    rank = factory_rank(keep)
    if names and (rank is not None or affine):
        raise ValueError("Expected layerwise targets in full mode of a linear model (as the streamed engine). "
                         f"Got keep={keep!r}, affine={affine}.")
    texts = prompt_texts(prompts, n_tokens, seed=seed) if isinstance(prompts, int) else list(prompts)
    run = run_description(model, n_layers=n_layers, dtype=dtype, keep=keep, detach=detach, row_block=row_block,
                          targets=names, mode=mode, affine=affine)
    truths: dict[str, PromptTruth] = {}
    with create_store(path, run, model_data=lambda: model.model_data(storage_dtype(dtype))) as store:
        for line, text in enumerate(texts, start=1):
            truth = synthetic_prompt(model, run, text, n_layers=n_layers, targets=names, affine=affine, seed=seed)
            if truth.id not in truths:
                write_prompt(store, model, run, truth, line=line, token_block=token_block,
                             graph=graphs(truth) if graphs is not None else None)
                truths[truth.id] = truth
    return SyntheticStore(Path(path), run, model, truths)
