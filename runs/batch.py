"""One prompt through the engine into a store: its row blocks streamed into a staged group that
becomes visible only when complete (see ``store/backend/zarr_writer.py``), and the run's description.

Used by both ways of running a corpus: one process (``runs/local.py``) and the workers of a
dask.distributed cluster (``runs/cluster.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from detjac import __version__
from detjac.store import NO_JACOBIAN

from .description import RunDescription
from .prompts import PromptLine

if TYPE_CHECKING:
    from detjac.engine import Engine, Plan, Trace
    from detjac.store import PromptWriter, StoreWriter
    from detjac.targets import Target

LOW_RANK_PASSES = 3  # sweeps of the row stream per prompt in low-rank mode (2 power iterations)


def write_prompt(store: StoreWriter, engine: Engine, pid: str, item: PromptLine, ids: list[int], run: RunDescription,
                 targets: list[Target], bar: Any, progress: bool = True, sums: Any = None) -> float:
    """One prompt through ``engine`` into ``store``; returns the output's reconstruction error. ``progress`` shows the
    engine's own bar of the forward pass (``bar`` alone counts the blocks).

    What the prompt produces decides how it is written: its whole Jacobian, block by block, with every layerwise
    ``targets`` Jacobian and, in a ``--lens`` run, its lens blocks (:func:`_write_swept`); or, with ``--keep rank:K``,
    the output's top triplets (:func:`_write_low_rank`). A ``--graph`` run (``run.graph``) commits either with its
    attribution graph (:func:`graph_json`)."""
    graph = graph_json(engine, pid, ids, run) if run.graph else None
    trace = engine.trace(ids, position=run.position, progress=progress)
    prompt = _Prompt(store, engine, pid, item, ids, run, trace, int(engine.logits(trace.output).argmax()), graph)
    if run.rank is not None:
        assert not targets, "a low-rank run has no layerwise targets (refused by check_options)"
        return _write_low_rank(prompt, run.rank, bar)
    return _write_swept(prompt, targets, bar, sums)


@dataclass
class _Prompt:
    """One prompt on its way into the store, and what every kind of prompt writes the same way."""

    store: StoreWriter
    engine: Engine
    pid: str
    item: PromptLine
    ids: list[int]
    run: RunDescription
    trace: Trace
    next_id: int  # the token the model predicts
    graph: dict[str, Any] | None

    @property
    def storage(self) -> str:
        return storage_dtype(self.run.dtype)

    def begin(self, plan: Plan, *, rank: int | None = None, layerwise: dict[str, Any] | None = None,
              jacobian: bool = True) -> Any:
        """The staged prompt group (``store.begin``), shaped by ``plan`` and by what the prompt keeps."""
        d = self.engine.d_model
        return self.store.begin(self.pid, n_rows=d, n_tokens=len(self.ids), n_cols=d, dtype=self.storage,
                                row_block=plan.row_block, rank=rank, layerwise=layerwise,
                                shard_bytes=_shard_bytes(self.engine), jacobian=jacobian, graph=self.graph is not None)

    def check(self, errors: dict[Target, float]) -> None:
        """Refuse a detached float64 target whose reconstruction is not exact (:func:`detjac.exactness.check_exact`)."""
        from detjac.exactness import check_exact

        for t, e in errors.items():
            check_exact(e, self.run.dtype, detached=self.run.detach, where=f"Prompt on line {self.item.line}: ",
                        what="" if t.is_output else t.name)

    def commit(self, writer: PromptWriter, error: float, extra: dict[str, Any]) -> None:
        """The prompt's small arrays, its graph, and its attributes (with ``extra``), which make it visible."""
        trace = self.trace
        _write_small(writer, trace.embeddings, trace.output, self.ids, self.storage, trace.bias)
        if self.graph is not None:
            writer.write_graph(self.graph)
        affine = {"affine": True} if trace.bias is not None else {}
        writer.commit({**_prompt_attrs(self.engine.tokenizer, self.item, self.ids, self.next_id, error, self.run,
                                       self.storage), **extra, **affine})


def _write_swept(prompt: _Prompt, targets: list[Target], bar: Any, sums: Any) -> float:
    """The output's Jacobian (unless ``--keep none``) and every layerwise ``targets`` Jacobian, block by block, with
    each target's state (and source, when not the embeddings). A ``--lens`` run (``run.lens``): the ``to_output``
    rows of the lens layers are not stored but their target-position blocks collected
    (:class:`detjac.runs.lens_run.SamePosition`), each checked to rebuild the output from its layer's states, and
    once the prompt is committed added to ``sums`` (a :class:`detjac.analysis.lens.lens_sums.RunningSums`); without
    the output's Jacobian the worst of those reconstruction errors is returned."""
    from detjac.store import LayerwiseSpec
    from detjac.targets import OUTPUTS

    from .lens_run import SamePosition, lens_targets

    engine, run, trace, storage = prompt.engine, prompt.run, prompt.trace, prompt.storage
    lens = lens_targets(run)
    output = [OUTPUTS] if run.keeps_jacobian else []
    plan = engine.plan(trace, [*output, *targets, *lens], mode=run.mode, row_block=run.row_block)
    collected = SamePosition(lens, run.position, len(prompt.ids), engine.d_model) if lens else None
    specs = {t.name: LayerwiseSpec(t.layer, t.component, t.local, plan.mode(t), plan.token_block) for t in targets}
    with prompt.begin(plan, layerwise=specs or None, jacobian=bool(output)) as writer:
        errors = _stream_full(engine, trace, plan, writer, storage, bar, collected)
        extra: dict[str, Any] = {**_layerwise_attrs(errors, specs), **engine.record(plan)}
        prompt.check(errors)
        for t in targets:
            writer.write_layerwise(t.name, "output", _numpy(trace.value(t), storage))
            if t.source_array is not None:  # what the Jacobian multiplies, when not the input embeddings
                writer.write_layerwise(t.name, t.source_array, _numpy(trace.source(t), storage))
        error = errors[OUTPUTS] if output else max(errors[t] for t in lens)
        if lens:
            extra["lens"] = {t.name: errors[t] for t in lens}
        if not output:
            extra["keep"] = NO_JACOBIAN
        prompt.commit(writer, error, extra)
    if collected is not None and sums is not None:  # counted only once committed: see detjac.analysis.lens.lens_sums
        sums.add(prompt.store, prompt.pid, collected.blocks)
    return error


def _write_low_rank(prompt: _Prompt, rank: int, bar: Any) -> float:
    """``--keep rank:K``: :data:`LOW_RANK_PASSES` sweeps of the output's row blocks through a subspace iteration;
    only the top ``rank`` triplets are stored."""
    from detjac.targets import OUTPUTS

    plan = prompt.engine.plan(prompt.trace, [OUTPUTS], mode="reverse", row_block=prompt.run.row_block)
    with prompt.begin(plan, rank=rank) as writer:
        errors, extra = _stream_low_rank(prompt.engine, prompt.trace, plan, writer, rank, LOW_RANK_PASSES, bar)
        prompt.check(errors)
        prompt.commit(writer, errors[OUTPUTS], extra)
    return errors[OUTPUTS]


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


def _layerwise_attrs(errors: dict[Target, float], specs: dict[str, Any]) -> dict[str, Any]:
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
                 collected: Any = None) -> dict[Target, float]:
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
                     bar: Any) -> tuple[dict[Target, float], dict[str, Any]]:
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
