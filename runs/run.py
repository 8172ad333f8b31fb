"""A corpus run from start to end (``detjac run``): check the options, plan, open the store, compute, count.

:func:`run_corpus` is the one entry point, and it prints nothing: what it has to say while running goes to a ``log``
callback, and the counts come back in a :class:`RunOutcome`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detjac.errors import InvalidArgumentError
from detjac.graph_settings import GraphSettings
from detjac.model_settings import LoadSpec

from .scheduler import ClusterOptions

if TYPE_CHECKING:
    from detjac.engine import BlockSink, Engine, ModelRef
    from detjac.store import Keep, StoreReader, StoreWriter

    from .plan import PromptTask, RunPlan, RunSummary

Log = Callable[[str], None]


@dataclass(frozen=True)
class RunOptions:
    """How ``detjac run`` computes and stores: the command's options, by the same names. ``load`` says how the
    model loads (a :class:`~detjac.model_settings.LoadSpec`: ``dtype``, ``device``, ``streamed``, ``max_memory``,
    ``quantize``; ``detach=False`` stores the ordinary Jacobian, ``--ordinary``; ``convention`` picks the family's
    detach convention, recorded in the store's run attributes when not its default); ``cluster`` where the prompts
    are computed (a :class:`~detjac.runs.scheduler.ClusterOptions`: ``workers``, a LocalCluster of that many
    processes, and ``scheduler``, an existing cluster's address, exclude each other; with neither, this process
    computes every prompt). ``lens`` accumulates the lens at ``layers`` (default
    all) while computing, storing no layerwise Jacobian and, unless ``keep`` is ``full``, no Jacobian at all
    (``keep`` None: ``full``, or ``none`` with ``lens``); its sums are flushed every ``lens_flush`` prompts.
    ``graph`` (None: none) stores each prompt's attribution graph too, computed with these settings
    (docs/graphs.md, "In the store"); a graph with fewer links than their ``heads`` has all of them split.
    """

    load: LoadSpec = field(default_factory=LoadSpec)
    cluster: ClusterOptions = field(default_factory=ClusterOptions)
    row_block: int | None = None
    max_tokens: int | None = None
    keep: Keep | str | None = None  # --keep's text; check_options parses it into a Keep
    layers: str | None = None
    components: str = "layer"
    mode: str = "auto"
    force_new: bool = False
    lens: bool = False
    lens_flush: int = 1
    graph: GraphSettings | None = None

    @property
    def layerwise(self) -> bool:
        """A lens or ``--layers``: targets only the layer-streamed engine computes (:func:`check_options` then asks
        for it)."""
        return self.lens or bool(self.layers)


@dataclass(frozen=True)
class RunOutcome:
    """What a run did: its counts (``summary``), the prompts now in the store, whether it was interrupted."""

    summary: Any  # detjac.runs.plan.RunSummary
    out: str
    total: int  # complete prompts in the store after the run
    distributed: bool
    interrupted: bool = False
    lens: dict[str, Any] | None = None  # a --lens run: the fit's report, or {"uncounted": n}
    stored_worst_error: float | None = None  # the largest reconstruction error recorded by the store's prompts

    @property
    def exit_code(self) -> int:
        """0 every prompt stored, 3 some prompts failed (or a --lens run left prompts uncounted), 130 interrupted."""
        uncounted = bool(self.lens and self.lens.get("uncounted"))
        return 130 if self.interrupted else 3 if self.summary.failed or uncounted else 0


def check_options(options: RunOptions) -> RunOptions:
    """The options with the load spec's ``streamed`` set when implied (by ``layers`` or ``lens`` here, by
    ``max_memory`` or ``quantize`` in the spec: :attr:`~detjac.model_settings.LoadSpec.streamed_engine`); raises for
    combinations that cannot run (before any model is loaded).

    Raises
    ------
    InvalidArgumentError
        For an unparsable ``keep``, ``components`` without ``layers``, ``layers`` with a low-rank
        ``keep``, a ``mode`` without the streamed engine, or both ``workers`` and ``scheduler``; with ``lens``,
        ``components``, a low-rank ``keep`` or a ``lens_flush`` below 1; ``keep`` none without ``lens``; ``graph``
        with ``detach`` False (``--ordinary``), or graph settings out of range.
    """
    from detjac.store import NO_JACOBIAN, Keep
    from detjac.targets import parse_components

    o = replace(options, keep=Keep.parse(options.keep or (NO_JACOBIAN if options.lens else "full")))
    if o.lens:
        _check_lens_options(o)
    elif not o.keep.jacobian:
        raise InvalidArgumentError("Expected --keep none with --lens only (the prompts' Jacobians then go into the "
                                   "lens's sums). Got --keep none alone: every prompt would keep nothing to analyse.")
    if o.graph is not None:
        o = replace(o, graph=_check_graph_options(o))
    streamed = o.load.streamed_engine or o.layerwise
    if o.layers is None and o.components != "layer":
        raise InvalidArgumentError(f"Expected --layers with --components. Got --components {o.components} alone.")
    if o.layers is not None:
        parse_components(o.components)  # an unknown component is refused before any model loads
    if o.layers is not None and not o.keep.full and not o.lens:
        raise InvalidArgumentError(f"Expected --keep full with --layers (layerwise Jacobians are stored whole). "
                                   f"Got --keep {o.keep}.")
    if not streamed and o.mode != "auto":
        raise InvalidArgumentError(f"Expected --mode with the streamed engine (--streamed). Got --mode {o.mode} alone.")
    o.cluster.check()  # before a store is created or a model loaded
    return replace(o, load=replace(o.load, streamed=streamed))


def _check_graph_options(o: RunOptions) -> GraphSettings:
    """A run's graph settings, checked: what its store records (:meth:`GraphSettings.stored`), each graph's links split
    up to ``heads``."""
    if not o.load.detach:
        raise InvalidArgumentError("Expected --graph without --ordinary. Got both: an attribution graph is defined on "
                                   "the detached model (its edges sum to each node's value only with the gates, "
                                   "attention and norm scales frozen).")
    graph = replace(o.graph.check(), heads_up_to=True)
    recorded = replace(GraphSettings.of_stored(graph.stored()), rows_per_pass=graph.rows_per_pass)
    if graph != recorded:  # a setting the store would not record would give prompts an identity they do not have
        raise InvalidArgumentError(f"Expected a run's graph settings among those its store records (max_nodes, "
                                   f"node_threshold, edge_threshold, heads; rows_per_pass). Got {o.graph}.")
    return graph


def _check_lens_options(o: RunOptions) -> None:
    from .lens_run import check_flush

    if o.components != "layer":
        raise InvalidArgumentError(f"Expected --lens without --components (it sums dy/dh_L, the to_output target, at "
                                   f"the --layers given, all by default, and stores no layerwise Jacobian). Got "
                                   f"--components {o.components}.")
    if o.keep.low_rank:
        raise InvalidArgumentError(f"Expected --keep none (the default with --lens) or full with --lens. Got --keep "
                                   f"{o.keep}: the low-rank sketch sweeps the output alone, without the layers' rows.")
    check_flush(o.lens_flush)


def run_corpus(model: str | ModelRef, prompts: str | Path | Any, out: str, options: RunOptions,
               log: Log | None = None, engine: Engine | None = None, tee: BlockSink | None = None) -> RunOutcome:
    """Detached Jacobians of ``model`` on every prompt of the file ``prompts``, into the store ``out``.

    Parameters
    ----------
    model : str or ModelRef
        A checkpoint folder, a GGUF file, a Hugging Face hub id (``org/name``) or ``default``, resolved here once
        the options are checked; or a :class:`~detjac.engine.ModelRef` resolved already (a GGUF file inside a
        folder or hub id, a hub revision: ``ModelRef.resolve(model, gguf_file, revision)``).
    prompts : str, Path or PromptsFile
        A .txt (one prompt per line) or .jsonl file, or prompts already read (:mod:`detjac.runs.prompts`).
    out : str
        The store: a path or a ``file://`` URL; created, or resumed.
    options : RunOptions
    log : callable or None
        Called with a line on the plan (prompts, duplicates, already stored, to compute) and,
        for a distributed run, with where its cluster runs.
    engine : Engine or None
        The model loaded already (in one process only); None: loaded from ``model`` and ``options``.
    tee : BlockSink or None
        With ``engine``: a sink every prompt's blocks also go to (:class:`detjac.engine.Tee`).

    Returns
    -------
    RunOutcome
        ``interrupted`` after Ctrl-C (KeyboardInterrupt), in one process or distributed: the prompts committed so
        far stay in the store and the same call resumes.

    Raises
    ------
    InvalidArgumentError
        See :func:`check_options`; PromptError, StoreError and the other DetjacErrors of planning
        and computing.
    """
    from detjac.engine import ModelRef

    from .plan import open_run_store, prepare_run

    o = check_options(options)
    spec = replace(o.load, model=ModelRef.of(model))  # a string is the API's: resolved here, once
    # A distributed run's client plans on the CPU; the workers compute on --device.
    plan = prepare_run(spec.model.name, prompts, spec, row_block=o.row_block, max_tokens=o.max_tokens, keep=o.keep,
                       layers=o.layers, components=o.components, mode=o.mode, lenient=o.cluster.distributed,
                       load_device="cpu" if o.cluster.distributed else None, lens=o.lens, engine=engine, tee=tee,
                       graph=o.graph)
    summary = plan.summary()
    interrupted = False
    restored_line = f"No prompt was stored: the store --force-new replaced is back at {out}, unchanged."
    with open_run_store(plan, out, o.force_new) as store:
        try:
            tasks = plan.pending(store, summary)
            if log is not None and store.restored_earlier is not None:
                log(f"A run with --force-new was killed before it stored a prompt: the store it replaced is back at "
                    f"{out} (it was kept aside as {store.restored_earlier.name}).")
            if log is not None:
                log(plan_line(plan, summary, tasks, prompts, out))
            if o.cluster.distributed:
                interrupted = _run_distributed(plan, store, tasks, summary, o, log)
            else:
                from .local import run_local

                try:
                    run_local(plan, store, tasks, summary, o.lens_flush)
                except KeyboardInterrupt:  # as a distributed run: committed prompts stay, the same command resumes
                    interrupted = True
        except BaseException:
            store.discard()  # a store this run created and that holds nothing goes with the refusal
            if log is not None and store.restored is not None:
                log(restored_line)
            raise
        total = len(store.prompt_ids())
        from .lens_run import finish

        lens = None if interrupted else finish(store, plan.run)
        stored_worst = None if summary.written else recorded_worst_error(store)
    if log is not None and store.restored is not None:
        log(restored_line)
        total = len(store.prompt_ids())
    return RunOutcome(summary, out, total, o.cluster.distributed, interrupted, lens, stored_worst)


def recorded_worst_error(store: StoreReader) -> float | None:
    """The largest reconstruction error the store's prompts recorded when they were computed (their attributes:
    nothing is recomputed; ``detjac store verify`` recomputes); None when none records one."""
    errors = []
    for pid in store.prompt_ids():
        value = store.prompt_attrs(pid).get("reconstruction_error")
        if isinstance(value, (int, float)):
            errors.append(float(value))
    return max(errors, default=None)


def run_one(model: str | ModelRef, prompt: str, out: str, options: RunOptions, engine: Engine | None = None,
            tee: BlockSink | None = None) -> str:
    """One prompt (text) into the store ``out`` (created, or resumed), as ``detjac run`` would store it from a
    file holding that line, with ``engine`` and ``tee`` when given (see :func:`run_corpus`); returns its prompt id."""
    from detjac.store import open_store, prompt_id

    from .prompts import PromptLine, PromptsFile

    prompts = PromptsFile(Path("--prompt"), [PromptLine(1, prompt)], 0)
    run_corpus(model, prompts, out, replace(options, cluster=ClusterOptions()), engine=engine, tee=tee)
    return prompt_id(open_store(out).run, prompt)


def plan_line(plan: RunPlan, summary: RunSummary, tasks: list[Any], prompts: str | Path, out: str) -> str:
    """What the run will do: prompts read, blank lines, duplicates, already stored, to compute, refused."""
    refused = sum(t.error is not None for t in tasks)
    what = f" and {len(plan.targets)} layerwise Jacobians per prompt" if plan.targets else ""
    return (f"{len(plan.prompts.prompts)} prompts in {prompts} ({plan.prompts.blank} blank lines "
            f"skipped, {summary.duplicates} duplicates); {summary.skipped_complete} already in {out}; "
            f"{len(tasks) - refused} to compute{what}"
            + (f"; {refused} cannot be run (recorded as failed)." if refused else "."))


def model_ref(model: str, revision: str | None = None) -> str:
    """Where every process finds ``model`` (:attr:`detjac.engine.ModelRef.location`)."""
    from detjac.engine import ModelRef

    return ModelRef.resolve(model, revision=revision).location


def _run_distributed(plan: RunPlan, store: StoreWriter, tasks: list[PromptTask], summary: RunSummary, o: RunOptions,
                     log: Log | None) -> bool:
    """Run ``tasks`` on a cluster; returns True when interrupted (Ctrl-C), after cancelling what was queued."""
    from .cluster import run_on_cluster
    from .scheduler import dask_cluster

    c = o.cluster
    # LocalCluster workers share this machine's cores; a scheduler's workers keep their own thread settings.
    threads = max(1, len(os.sched_getaffinity(0)) // c.workers) if c.workers else None
    try:
        with dask_cluster(c, trim_memory=False, log=log) as client:
            run_on_cluster(client, plan, store, tasks, summary, torch_threads=threads, local=c.scheduler is None,
                           lens_flush=o.lens_flush)
    except KeyboardInterrupt:
        return True
    return False
