"""One prompt through the engine into a store: its row blocks streamed into a staged group that
becomes visible only when complete (see ``store/backend/zarr_writer.py``), and the run's description.

Used by both ways of running a corpus: one process (``runs/local.py``) and the workers of a
dask.distributed cluster (``runs/cluster.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from detjac import __version__
from detjac.store import NO_JACOBIAN, storage_dtype

from .description import RunDescription
from .prompts import PromptLine

if TYPE_CHECKING:
    from detjac.engine import BlockSink, Engine, JacobianBlock, PromptProducts
    from detjac.store import PromptWriter, StoreWriter
    from detjac.targets import Target

LOW_RANK_PASSES = 3  # sweeps of the row stream per prompt in low-rank mode (2 power iterations)


def write_prompt(store: StoreWriter, engine: Engine, pid: str, item: PromptLine, ids: list[int], run: RunDescription,
                 targets: list[Target], bar: Any, progress: bool = True, sums: Any = None,
                 tee: BlockSink | None = None) -> float:
    """One prompt through ``engine`` into ``store`` by one :func:`detjac.engine.prompt_pass` (one trace); returns the
    output's reconstruction error. ``progress`` shows the engine's own bar of the forward pass (``bar`` alone counts
    the blocks).

    What the prompt produces decides how it is written: its whole Jacobian, block by block, with every layerwise
    ``targets`` Jacobian and, in a ``--lens`` run, its lens blocks (:class:`_Swept`); or, with ``--keep rank:K``,
    the output's top triplets (:class:`_LowRank`). A ``--graph`` run (``run.graph``) commits either with its
    attribution graph, built on the same trace by the graphs layer's step (:func:`detjac.graphs.graph_step`, as
    ``detjac graph`` builds it) and written by :func:`detjac.runs.graph_run.graph_json`. ``tee``: a sink the
    blocks also go to (:class:`detjac.engine.Tee`)."""
    from detjac.engine import Tee, prompt_pass
    from detjac.targets import OUTPUTS

    from .lens_run import lens_targets

    sink: _Prompt
    if run.rank is not None:
        assert not targets, "a low-rank run has no layerwise targets (refused by check_options)"
        sink, wanted, mode = _LowRank(store, engine, pid, item, ids, run, bar), [OUTPUTS], "reverse"
    else:
        lens = lens_targets(run)
        sink = _Swept(store, engine, pid, item, ids, run, bar, targets, lens)
        wanted, mode = [*([OUTPUTS] if run.keeps_jacobian else []), *targets, *lens], run.mode
    graph = None
    if run.graph is not None:  # the graphs layer's step, as `detjac graph` builds its graph
        from detjac.graphs import graph_step

        graph = graph_step(engine, run.graph, progress)
    prompt_pass(engine, ids, wanted, position=run.position, mode=mode, row_block=run.row_block, graph=graph,
                sink=sink if tee is None else Tee(sink, tee), progress=progress)
    if isinstance(sink, _Swept) and sink.collected is not None and sums is not None:
        sums.add(store, pid, sink.collected.blocks)  # counted only once committed: see detjac.analysis.lens.lens_sums
    return sink.error


class _Prompt:
    """One prompt on its way into the store (a :class:`detjac.engine.BlockSink`), and what every kind of prompt
    writes the same way."""

    def __init__(self, store: StoreWriter, engine: Engine, pid: str, item: PromptLine, ids: list[int],
                 run: RunDescription, bar: Any) -> None:
        self.store, self.engine, self.pid, self.item, self.ids, self.run, self.bar = (store, engine, pid, item, ids,
                                                                                     run, bar)
        self.writer: Any = None
        self.error = float("nan")

    @property
    def storage(self) -> str:
        return storage_dtype(self.run.dtype)

    @contextmanager
    def begin(self, products: PromptProducts, *, rank: int | None = None, layerwise: dict[str, Any] | None = None,
              jacobian: bool = True) -> Iterator[None]:
        """The staged prompt group (``store.begin``), shaped by the plan and by what the prompt keeps."""
        d, plan = self.engine.d_model, products.plan
        assert plan is not None  # the prompt pass plans before it opens a sink
        with self.store.begin(self.pid, n_rows=d, n_tokens=len(self.ids), n_cols=d, dtype=self.storage,
                              row_block=plan.row_block, rank=rank, layerwise=layerwise,
                              shard_bytes=budget_shard_bytes(self.engine), jacobian=jacobian,
                              graph=products.graph is not None) as writer:
            self.writer = writer
            yield

    def more(self) -> bool:
        return False

    def check(self, errors: dict[Target, float]) -> None:
        """Refuse a detached float64 target whose reconstruction is not exact (:func:`detjac.exactness.check_exact`)."""
        from detjac.exactness import check_exact

        for t, e in errors.items():
            check_exact(e, self.run.dtype, detached=self.run.detach, where=f"Prompt on line {self.item.line}: ",
                        what="" if t.is_output else t.name)

    def commit(self, products: PromptProducts, error: float, extra: dict[str, Any]) -> None:
        """The prompt's small arrays, its graph, and its attributes (with ``extra``), which make it visible."""
        trace, writer = products.trace, self.writer
        self.error = error
        _write_small(writer, trace.embeddings, trace.output, self.ids, self.storage, trace.bias)
        if products.graph is not None:
            from .graph_run import graph_json

            writer.write_graph(graph_json(products.graph, self.pid, self.run))
        affine = {"affine": True} if trace.bias is not None else {}
        next_id = int(self.engine.logits(trace.output).argmax())  # the token the model predicts
        writer.commit({**_prompt_attrs(self.engine.tokenizer, self.item, self.ids, next_id, error, self.run,
                                       self.storage), **extra, **affine})


class _Swept(_Prompt):
    """The output's Jacobian (unless ``--keep none``) and every layerwise ``targets`` Jacobian, block by block, with
    each target's state (and source, when not the embeddings). A ``--lens`` run (``run.lens``): the ``to_output``
    rows of the lens layers are not stored but their target-position blocks collected
    (:class:`detjac.runs.lens_run.SamePosition`), each checked to rebuild the output from its layer's states, and
    once the prompt is committed added to the run's sums (a :class:`detjac.analysis.lens.lens_sums.RunningSums`);
    without the output's Jacobian the worst of those reconstruction errors is the prompt's."""

    def __init__(self, store: StoreWriter, engine: Engine, pid: str, item: PromptLine, ids: list[int],
                 run: RunDescription, bar: Any, targets: list[Target], lens: list[Target]) -> None:
        from .lens_run import SamePosition

        super().__init__(store, engine, pid, item, ids, run, bar)
        self.targets, self.lens = targets, lens
        self.collected = SamePosition(lens, run.position, len(ids), engine.d_model) if lens else None
        self.specs: dict[str, Any] = {}

    def open(self, products: PromptProducts) -> Any:
        from detjac.store import LayerwiseSpec

        plan = products.plan
        assert plan is not None
        self.specs = {t.name: LayerwiseSpec(t.layer, t.component, t.local, plan.mode(t), plan.token_block)
                      for t in self.targets}
        # ``bar`` counts the blocks: the engine's own block bar would count them again, beside it, on another clock.
        self.bar.reset(total=plan.n_row_blocks * len(plan.reverse) + plan.n_token_blocks * len(plan.forward))
        return self.begin(products, layerwise=self.specs or None, jacobian=self.run.keeps_jacobian)

    def take(self, b: JacobianBlock) -> None:
        if self.collected is not None and b.target in self.collected.index:
            self.collected.take(b)
        else:
            name = "jacobian" if b.target.is_output else b.target.name
            self.writer.write_block(name, b.start, b.stop, b.token_start, b.token_stop, _numpy(b.values, self.storage))
        self.bar.update()

    def finish(self, products: PromptProducts) -> None:
        from detjac.targets import OUTPUTS

        errors, trace, plan = products.errors, products.trace, products.plan
        assert plan is not None
        extra: dict[str, Any] = {**_layerwise_attrs(errors, self.specs), **self.engine.record(plan)}
        self.check(errors)
        for t in self.targets:
            self.writer.write_layerwise(t.name, "output", _numpy(trace.value(t), self.storage))
            if t.source_array is not None:  # what the Jacobian multiplies, when not the input embeddings
                self.writer.write_layerwise(t.name, t.source_array, _numpy(trace.source(t), self.storage))
        output = self.run.keeps_jacobian
        error = errors[OUTPUTS] if output else max(errors[t] for t in self.lens)
        if self.lens:
            extra["lens"] = {t.name: errors[t] for t in self.lens}
        if not output:
            extra["keep"] = NO_JACOBIAN
        self.commit(products, error, extra)


class _LowRank(_Prompt):
    """``--keep rank:K``: :data:`LOW_RANK_PASSES` sweeps of the output's row blocks through a subspace iteration;
    only the top ``rank`` triplets are stored."""

    def open(self, products: PromptProducts) -> Any:
        from detjac.store import SubspaceIteration

        plan = products.plan
        assert plan is not None and self.run.rank is not None
        n, d = products.trace.embeddings.shape
        self.iteration = SubspaceIteration(self.engine.d_model, n, d, self.run.rank, passes=LOW_RANK_PASSES)
        self.bar.reset(total=plan.n_row_blocks * LOW_RANK_PASSES)
        return self.begin(products, rank=self.run.rank)

    def take(self, b: JacobianBlock) -> None:
        self.iteration.update(b.start, b.stop, _numpy(b.values, "float64"))
        self.bar.update()

    def more(self) -> bool:
        return bool(self.iteration.end_pass())

    def finish(self, products: PromptProducts) -> None:
        from detjac.targets import OUTPUTS

        attrs = self.writer.write_triplets(*self.iteration.finish())
        self.check(products.errors)
        self.commit(products, products.errors[OUTPUTS], {**attrs, "passes": LOW_RANK_PASSES})


def _layerwise_attrs(errors: dict[Target, float], specs: dict[str, Any]) -> dict[str, Any]:
    """The ``layerwise`` attribute of a prompt: each target's reconstruction error and mode (none: no attribute)."""
    if not specs:
        return {}
    return {"layerwise": {t.name: {"reconstruction_error": e, "mode": specs[t.name].mode}
                          for t, e in errors.items() if not t.is_output}}


def budget_shard_bytes(engine: Engine) -> int | None:
    """The Jacobian shard size a run writes with under the engine's CPU memory budget.

    Parameters
    ----------
    engine : Engine
        The engine whose CPU budget (``memory_budget("cpu")``) bounds the shards.

    Returns
    -------
    int or None
        At most 1/64 of the budget (the writer holds up to one shard and zarr about two more while it writes one);
        None without a budget: the store's default.
    """
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


def _numpy(t: Any, storage: str) -> Any:
    import torch

    return t.detach().to(device="cpu", dtype=getattr(torch, storage)).numpy()
