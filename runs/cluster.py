"""A corpus run on a dask.distributed cluster: the prompts spread over workers, into one store.

Each worker loads the model once (:class:`ModelPlugin`) and commits its prompts under the client's lease, each exactly
once; a failing prompt is recorded under ``failed/`` and does not stop the run. Details: docs/user-guide.md,
"Distributed runs: one corpus, many workers, one store"."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed import WorkerPlugin

from detjac.errors import (
    InvalidArgumentError,
    LinearizationError,
    PromptError,
    StoreError,
    UnsupportedModelError,
    WorkerError,
)

from .description import RunDescription
from .plan import Failure, PromptTask, RunPlan, RunSummary, write_one

if TYPE_CHECKING:
    from detjac.engine import Engine
    from detjac.model_settings import LoadSpec
    from detjac.store import StoreWriter
    from detjac.targets import Target

# Errors that come back the same on every worker: recorded at once, never retried.
DETERMINISTIC = (PromptError, LinearizationError, InvalidArgumentError, UnsupportedModelError)
RETRIES = 2  # further attempts at a prompt whose task raised anything else (a transient I/O error, say)


class ModelPlugin(WorkerPlugin):
    """The run's model on one worker: loaded once, at the worker's first prompt, and dropped when the run ends."""

    def __init__(self, spec: LoadSpec, name: str, torch_threads: int | None = None, local: bool = False) -> None:
        self.spec, self.name, self.torch_threads, self.local = spec, name, torch_threads, local
        self.loads, self.load_seconds = 0, 0.0
        self._loaded: Engine | None = None
        self._sums: Any = None  # a --lens run's RunningSums on this worker
        self._guard: Any = None

    def setup(self, worker: Any) -> None:
        from detjac.machine import set_memory_cap

        self._guard = threading.Lock()  # made on the worker: locks do not pickle
        # the worker's share of the machine bounds what the engine sizes without a budget (its default row block)
        set_memory_cap(getattr(getattr(worker, "memory_manager", None), "memory_limit", None))
        if self.local:  # a LocalCluster's workers share the terminal: Ctrl-C is the client's to handle
            with contextlib.suppress(ValueError):  # not the main thread: leave the handler as it is
                signal.signal(signal.SIGINT, signal.SIG_IGN)

    def teardown(self, worker: Any) -> None:
        self._loaded = None

    def sums(self, run: RunDescription, flush_every: int) -> Any:
        """This worker's running lens sums (made at its first prompt; None when the run is not a --lens run)."""
        from .lens_run import running_sums

        with self._guard:
            if self._sums is None:
                self._sums = running_sums(run, flush_every)
            return self._sums

    def flush(self) -> None:
        """Write this worker's lens sums that are not on disk yet."""
        if self._sums is not None:
            self._sums.flush()

    def get(self) -> Engine:
        """The model's engine; the first call on this worker loads it (tasks on other threads wait for it)."""
        with self._guard:
            if self._loaded is None:
                import torch
                from transformers.utils import logging as hf_logging

                from detjac.engine import (  # before the clock: the load time is the model's
                    honour_cpu_budget,
                    load_engine,
                )

                hf_logging.disable_progress_bar()  # no weight-loading bars in the workers' logs
                if self.torch_threads:
                    torch.set_num_threads(self.torch_threads)
                start = time.perf_counter()
                try:
                    self._loaded = load_engine(self.spec)
                except Exception as exc:
                    raise WorkerError(f"A worker could not load the model {self.spec.model.location!r} on "
                                      f"{self.spec.device}: {type(exc).__name__}: {exc}") from exc
                honour_cpu_budget(self.spec.device, self.spec.max_memory)  # this worker process is the run's too
                self.loads += 1
                self.load_seconds += time.perf_counter() - start
            return self._loaded


@dataclass(frozen=True)
class PromptJob:
    """What every task of a run shares: the store, the lease to write under, the run, the model plugin."""

    store: str  # absolute path, the same on every worker (a shared file system)
    lease: str
    run: RunDescription
    targets: list[Target]
    plugin: str
    lens_flush: int = 1  # a --lens run: prompts between two flushes of a worker's sums


@dataclass(frozen=True)
class PromptOutcome:
    pid: str
    worker: str
    loads: int  # model loads on this worker so far (1 once it has loaded)
    load_seconds: float
    reconstruction_error: float | None = None
    failure: str | None = None  # why the prompt failed deterministically
    error: str | None = None  # the error's class


def compute_prompt(task: PromptTask, job: PromptJob) -> PromptOutcome:
    """A worker's task: compute ``task`` with the worker's model and commit it to the store."""
    from distributed import get_worker

    from detjac.progress import tqdm
    from detjac.store import attach_store

    worker = get_worker()
    plugin = worker.plugins[job.plugin]
    engine = plugin.get()
    try:
        store = attach_store(job.store, job.lease)
    except StoreError as exc:
        raise WorkerError(f"Worker {worker.address} could not write to the store {job.store} (every worker must "
                          f"see it at the same path): {exc}") from exc
    found = (task.pid, worker.address, plugin.loads, plugin.load_seconds)
    try:
        error = write_one(engine, store, task, job.run, job.targets, tqdm(disable=True), progress=False,
                          sums=plugin.sums(job.run, job.lens_flush))
    except DETERMINISTIC as exc:
        return PromptOutcome(*found, failure=str(exc), error=type(exc).__name__)
    return PromptOutcome(*found, reconstruction_error=error)


def run_on_cluster(client: Any, plan: RunPlan, store: StoreWriter, tasks: list[PromptTask], summary: RunSummary, *,
                   torch_threads: int | None = None, local: bool = False, progress: bool = True,
                   lens_flush: int = 1) -> RunSummary:
    """Compute ``tasks`` on the workers of ``client`` into ``store`` (opened for writing by this process).

    Tasks whose ``error`` is set are recorded as failed without computing. Counts, failures and
    model loads per worker go to ``summary``. ``torch_threads`` sets the workers' torch threads;
    ``local`` says the workers are this machine's LocalCluster (they then leave Ctrl-C to the
    client). Raises WorkerError when a worker cannot load the model or reach the store (every
    prompt would fail the same way); KeyboardInterrupt cancels the prompts not yet committed
    and propagates. A ``--lens`` run: each worker keeps its own running sums (flushed every ``lens_flush``
    prompts) and every worker flushes when the run ends, interrupted or not; a worker that died took its
    unflushed sums along, and those committed prompts are recomputed by the next run.
    """
    from distributed import as_completed

    from detjac.progress import tqdm

    for task in tasks:
        if task.error is not None:
            _record(store, summary, task, Failure(task.item.line, task.error))
    runnable = [t for t in tasks if t.error is None]
    if not runnable:
        return summary
    lease = store.lease
    plugin = ModelPlugin(plan.spec, f"detjac-model-{lease}", torch_threads, local)
    job = PromptJob(str(store.path.resolve()), lease, plan.run, plan.targets, plugin.name, lens_flush)
    window = max(8, 2 * sum(client.nthreads().values()))  # prompts queued at once: workers never wait
    queue = iter(runnable)
    running: dict[str, tuple[PromptTask, Any]] = {}
    finished = as_completed()

    def submit_next() -> None:
        task = next(queue, None)
        if task is not None:
            future = client.submit(compute_prompt, task, job, key=f"detjac-prompt-{task.pid}-{lease}",
                                   retries=RETRIES)
            running[future.key] = (task, future)
            finished.add(future)

    client.register_plugin(plugin)
    try:
        with tqdm(total=len(runnable), desc="prompts", unit="prompt", disable=not progress) as bar:
            for _ in range(window):
                submit_next()
            for future in finished:
                task, _ = running.pop(future.key)
                _collect(store, summary, task, future)
                future.release()
                submit_next()
                bar.set_postfix(error=f"{summary.worst_error or 0:.1e}", failed=len(summary.failed))
                bar.update()
    except BaseException:
        client.cancel([future for _, future in running.values()])
        raise
    finally:
        _flush_workers(client, plugin.name)
        _unregister(client, plugin.name)
    store.clear_staging()  # attempts of killed workers: no attempt of this run is running now
    return summary


def _collect(store: StoreWriter, summary: RunSummary, task: PromptTask, future: Any) -> None:
    from distributed import KilledWorker

    if future.status == "finished":
        outcome: PromptOutcome = future.result()
        summary.loads[outcome.worker] = (outcome.loads, outcome.load_seconds)
        if outcome.failure is None:
            summary.add_written(outcome.reconstruction_error or 0.0)
        else:
            _record(store, summary, task, Failure(task.item.line, outcome.failure, outcome.error or "", "compute"))
        return
    if future.status == "cancelled":
        _record(store, summary, task, Failure(task.item.line, "cancelled by the cluster", "CancelledError", "worker"))
        return
    exc = future.exception()
    if isinstance(exc, WorkerError):
        raise exc
    if isinstance(exc, KilledWorker):
        failure = Failure(task.item.line, "every worker that computed it died (killed, or out of memory: see the "
                                          f"workers' logs): {exc}", "KilledWorker", "worker")
    else:
        failure = Failure(task.item.line, f"{type(exc).__name__}: {exc} (after {RETRIES + 1} attempts)",
                          type(exc).__name__, "compute")
    _record(store, summary, task, failure)


def _record(store: StoreWriter, summary: RunSummary, task: PromptTask, failure: Failure) -> None:
    from detjac import __version__

    store.record_failure(task.pid, {"prompt": task.item.text, "line": task.item.line, "meta": task.item.meta,
                                    "reason": failure.reason, "error": failure.error, "stage": failure.stage,
                                    "detjac_version": __version__})
    summary.failed[task.pid] = failure


def _flush_lens(name: str, dask_worker: Any = None) -> None:
    plugin = dask_worker.plugins.get(name) if dask_worker is not None else None
    if plugin is not None:
        plugin.flush()


def _flush_workers(client: Any, name: str) -> None:
    """Every worker writes its --lens sums (nothing for another run); a dead cluster leaves them to a re-run."""
    try:
        client.run(_flush_lens, name)
    except Exception:  # noqa: BLE001 - the prompts whose sums are lost are recomputed by the next run
        pass


def _unregister(client: Any, name: str) -> None:
    """Drop the model plugin (and the workers' models) once the run is over; a closed cluster needs nothing."""
    try:
        client.unregister_worker_plugin(name)
    except Exception:  # noqa: BLE001 - the cluster may already be gone (interrupted, or shutting down)
        pass
