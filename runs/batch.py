"""One prompt through the engine into a store: its row blocks streamed into a staged group that
becomes visible only when complete (see ``store/backend/zarr_writer.py``), and the run's description.

Used by both ways of running a corpus: one process (``runs/local.py``) and the workers of a
dask.distributed cluster (``runs/cluster.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from detjac import __version__
from detjac.errors import LinearizationError
from detjac.store import NO_JACOBIAN

from .description import RunDescription
from .prompts import PromptLine

if TYPE_CHECKING:
    from detjac.engine import Engine, Plan, Trace
    from detjac.store import PromptWriter, StoreWriter

LOW_RANK_PASSES = 3  # sweeps of the row stream per prompt in low-rank mode (2 power iterations)


def parse_keep(keep: str) -> int | None:
    """``full`` and ``none`` (no Jacobian: a ``--lens`` run) -> None; ``rank:K`` -> K (a positive integer); anything
    else is an error."""
    from detjac.errors import InvalidArgumentError

    if keep in ("full", NO_JACOBIAN):
        return None
    kind, _, value = keep.partition(":")
    if kind == "rank" and value.isdigit() and int(value) > 0:
        return int(value)
    raise InvalidArgumentError(f"Expected --keep full, --keep rank:K with K a positive integer, or --keep none (with "
                               f"--lens). Got {keep!r}.")


def write_prompt(store: StoreWriter, engine: Engine, pid: str, item: PromptLine, ids: list[int], run: RunDescription,
                 targets: list[Any], bar: Any, progress: bool = True, sums: Any = None) -> float:
    """One prompt through ``engine`` into ``store``: the output's Jacobian and every layerwise ``targets``
    Jacobian, block by block (or, in low-rank mode, the output's top triplets); returns the output's
    reconstruction error. ``progress`` shows the engine's own bar of the forward pass (``bar`` alone counts the blocks).

    A ``--lens`` run (``run.lens``): the ``to_output`` rows of the lens layers are not stored but their
    target-position blocks collected (:class:`detjac.runs.lens_run.SamePosition`), each checked to rebuild the
    output from its layer's states, and once the prompt is committed added to ``sums`` (a
    :class:`detjac.analysis.lens.lens_sums.RunningSums`); with ``keep`` none the output's Jacobian is not computed
    and the worst of those reconstruction errors is returned. A ``--graph`` run (``run.graph``) commits the prompt
    with its attribution graph (:func:`graph_json`)."""
    from detjac.store import LayerwiseSpec
    from detjac.targets import OUTPUTS

    from .lens_run import SamePosition, lens_targets

    storage = storage_dtype(run.dtype)
    rank = parse_keep(run.keep)
    lens = lens_targets(run)
    output = [OUTPUTS] if run.keep != NO_JACOBIAN else []
    graph = graph_json(engine, pid, ids, run) if run.graph else None
    trace = engine.trace(ids, position=run.position, progress=progress)
    plan = engine.plan(trace, [*output, *targets, *lens], mode="reverse" if rank is not None else run.mode,
                       row_block=run.row_block)
    next_id = int(engine.logits(trace.output).argmax())
    n, d = len(ids), engine.d_model
    collected = SamePosition(lens, run.position, n, d) if lens else None
    specs = {t.name: LayerwiseSpec(t.layer, t.component, t.local, plan.mode(t), plan.token_block) for t in targets}
    with store.begin(pid, n_rows=d, n_tokens=n, n_cols=d, dtype=storage, row_block=plan.row_block, rank=rank,
                     layerwise=specs or None, shard_bytes=_shard_bytes(engine), jacobian=bool(output),
                     graph=graph is not None) as writer:
        if rank is None:
            errors = _stream_full(engine, trace, plan, writer, storage, bar, collected)
            extra: dict[str, Any] = {**_layerwise_attrs(errors, specs), **engine.record(plan)}
        else:
            errors, extra = _stream_low_rank(engine, trace, plan, writer, rank, LOW_RANK_PASSES, bar)
        for t, e in errors.items():
            if run.detach:
                _check_exact(e, run.dtype, item, "" if t.is_output else t.name)
            if not t.is_output and t not in lens:
                writer.write_layerwise(t.name, "output", _numpy(trace.value(t), storage))
                if t.source_array is not None:  # what the Jacobian multiplies, when not the input embeddings
                    writer.write_layerwise(t.name, t.source_array, _numpy(trace.source(t), storage))
        error = errors[OUTPUTS] if output else max(errors[t] for t in lens)
        if lens:
            extra["lens"] = {t.name: errors[t] for t in lens}
        if not output:
            extra["keep"] = NO_JACOBIAN
        _write_small(writer, trace.embeddings, trace.output, ids, storage, trace.bias)
        if graph is not None:
            writer.write_graph(graph)
        affine = {"affine": True} if trace.bias is not None else {}
        writer.commit({**_prompt_attrs(engine.tokenizer, item, ids, next_id, error, run, storage), **extra,
                       **affine})
    if collected is not None and sums is not None:  # counted only once committed: see detjac.analysis.lens.lens_sums
        sums.add(store, pid, collected.blocks)
    return error


GRAPH_IDENTITY = ("config_sha256", "weights_sha256", "tokenizer_sha256")  # a stored graph's metadata.info names them


def graph_json(engine: Engine, pid: str, ids: list[int], run: RunDescription) -> dict[str, Any]:
    """The prompt's attribution graph as a ``--graph`` run stores it: :func:`detjac.engine.graph_dict` of
    :func:`detjac.engine.attribution_graph` with the run's graph settings, the prompt id as its slug, the run's
    ``model_id`` as its model and the run's model digests (:data:`GRAPH_IDENTITY`) in its ``metadata.info``."""
    from detjac.engine import attribution_graph, graph_dict

    settings = dict(run.graph or {})
    graph = attribution_graph(engine, ids, max_nodes=settings["max_nodes"])
    described = run.as_dict()
    identity = {key: described[key] for key in GRAPH_IDENTITY if isinstance(described.get(key), str)}
    return graph_dict(graph, slug=pid, model=run.model_id, node_threshold=settings["node_threshold"],
                      edge_threshold=settings["edge_threshold"], identity=identity)


def _layerwise_attrs(errors: dict[Any, float], specs: dict[str, Any]) -> dict[str, Any]:
    """The ``layerwise`` attribute of a prompt: each target's reconstruction error and mode (none: no attribute)."""
    if not specs:
        return {}
    return {"layerwise": {t.name: {"reconstruction_error": e, "mode": specs[t.name].mode}
                          for t, e in errors.items() if not t.is_output}}


def _shard_bytes(engine: Engine) -> int | None:
    """Under a CPU memory budget, jacobian shards of at most 1/64 of it (the writer holds up to one shard and
    zarr about two more while it writes one); None: the store's default."""
    from detjac.store import SHARD_BYTES

    budget = engine.memory_budget("cpu")
    return None if budget is None else max(1, min(SHARD_BYTES, budget // 64))


def _write_small(writer: PromptWriter, embeddings: Any, output: Any, ids: list[int], storage: str,
                 bias: Any = None) -> None:
    writer.write_array("embeddings", _numpy(embeddings, storage))
    writer.write_array("output", _numpy(output, storage))
    writer.write_array("token_ids", np.asarray(ids, dtype=np.int64))
    if bias is not None:  # an affine model: y = sum_k J_k x_k + bias
        writer.write_array("bias", _numpy(bias, storage))


def _stream_full(engine: Engine, trace: Trace, plan: Plan, writer: PromptWriter, storage: str, bar: Any,
                 collected: Any = None) -> dict[Any, float]:
    """Every target's blocks to the writer as they come (a lens target's to ``collected`` instead); the
    reconstructions are accumulated on the way. Returns each target's reconstruction error (the output's with an
    affine model's offset added)."""
    import torch

    from detjac.exactness import relative_error

    targets = plan.reverse + plan.forward
    recon = {t: torch.zeros_like(trace.value(t)) for t in targets}
    bar.reset(total=plan.n_row_blocks * len(plan.reverse) + plan.n_token_blocks * len(plan.forward))
    # ``bar`` counts the blocks: the engine's own block bar would count them again, beside it, on another clock.
    for b in engine.blocks(trace, targets, plan, progress=False):
        x = trace.source(b.target)[b.token_start:b.token_stop]
        recon[b.target][b.start:b.stop] += torch.einsum("rtc,tc->r", b.values, x)
        if collected is not None and b.target in collected.index:
            collected.take(b)
        else:
            name = "jacobian" if b.target.is_output else b.target.name
            writer.write_block(name, b.start, b.stop, b.token_start, b.token_stop, _numpy(b.values, storage))
        bar.update()
    return {t: relative_error(_plus_bias(recon[t], trace) if t.is_output else recon[t], trace.value(t))
            for t in targets}


def _plus_bias(recon: Any, trace: Trace) -> Any:
    """``sum_k J_k x_k`` plus the offset of an affine model (linear models have none)."""
    return recon + trace.bias if trace.bias is not None else recon


def _stream_low_rank(engine: Engine, trace: Trace, plan: Plan, writer: PromptWriter, rank: int, passes: int,
                     bar: Any) -> tuple[dict[Any, float], dict[str, Any]]:
    """``passes`` sweeps of the output's row blocks through a subspace iteration; only the triplets are stored."""
    import torch

    from detjac.exactness import relative_error
    from detjac.store import SubspaceIteration
    from detjac.targets import OUTPUTS

    n, d = trace.embeddings.shape
    iteration = SubspaceIteration(engine.d_model, n, d, rank, passes=passes)
    recon = torch.empty_like(trace.output)
    bar.reset(total=plan.n_row_blocks * passes)
    more = True
    while more:
        first_pass = iteration.pass_index == 0
        for block in engine.blocks(trace, [OUTPUTS], plan):
            if first_pass:  # the rows are the same in every pass
                recon[block.start:block.stop] = torch.einsum("rtc,tc->r", block.values, trace.embeddings)
            iteration.update(block.start, block.stop, _numpy(block.values, "float64"))
            bar.update()
        more = iteration.end_pass()
    attrs = writer.write_triplets(*iteration.finish())
    return {OUTPUTS: relative_error(_plus_bias(recon, trace), trace.output)}, {**attrs, "passes": passes}


def _check_exact(error: float, dtype: str, item: PromptLine, what: str = "") -> None:
    from detjac.exactness import FLOAT64_EXACTNESS_BOUND

    if dtype == "float64" and not error < FLOAT64_EXACTNESS_BOUND:
        of = f" of {what}" if what else ""
        raise LinearizationError(f"Prompt on line {item.line}: float64 reconstruction error{of} {error:.3e} is above "
                                 f"{FLOAT64_EXACTNESS_BOUND:.0e}; a nonlinearity escaped detaching.")


def _prompt_attrs(tokenizer: Any, item: PromptLine, ids: list[int], next_id: int, error: float,
                  run: RunDescription, storage: str) -> dict[str, Any]:
    from detjac.store import now
    from detjac.tokens import token_text, token_texts

    return {"prompt": item.text, "line": item.line, "meta": item.meta, "n_tokens": len(ids), "token_ids": ids,
            "tokens": token_texts(tokenizer, ids), "reconstruction_error": error,
            "next_token_id": next_id, "next_token": token_text(tokenizer, next_id) if tokenizer else None,
            "detached": run.detach, "dtype": run.dtype, "storage_dtype": storage, "model_id": run.model_id,
            "revision": run.revision, "model_type": run.model_type, "position": run.position,
            "detach_rules": list(run.detach_rules), "detjac_version": __version__, "written_at": now()}


def storage_dtype(dtype: str) -> str:
    """The dtype results are stored in: the compute dtype, but float32 for 16-bit ones (numpy has no bfloat16)."""
    return "float32" if dtype in ("bfloat16", "float16") else dtype


def _numpy(t: Any, storage: str) -> Any:
    import torch

    return t.detach().to(device="cpu", dtype=getattr(torch, storage)).numpy()
