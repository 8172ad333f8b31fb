"""A corpus run, planned once, then executed in one process (``local.py``) or on a cluster (``cluster.py``).

:func:`prepare_run` loads the model (:func:`load_for`), checks the prompts and describes the run;
:func:`open_run_store` creates or resumes the store, and :meth:`RunPlan.pending` leaves out the prompts already
in it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detjac.engine import BlockSink, Engine
    from detjac.graph_settings import GraphSettings
    from detjac.store import Keep, StoreWriter
    from detjac.targets import Target

from detjac.model_settings import LoadSpec

from .batch import write_prompt
from .description import RunDescription, StreamedSettings, describe_run, setting_differences
from .fingerprint import weights_difference, weights_identity
from .prompts import PromptLine, PromptsFile, check_tokenized, read_prompts, tokenize_each


def load_for(spec: LoadSpec, device: str | None = None) -> Engine:
    """The engine ``spec`` describes, on ``device`` when given (a distributed run's client plans on the CPU: then
    without the memory budget, which names the workers' devices, and streamed as the workers will be)."""
    from detjac.engine import load_engine

    if device is not None and device != spec.device:
        spec = replace(spec, device=device, max_memory=None, streamed=spec.streamed_engine)
    return load_engine(spec)


@dataclass(frozen=True)
class PromptTask:
    """One unique prompt of a run: its id, line and tokens, or why it cannot be run (``error``)."""

    pid: str
    item: PromptLine
    ids: list[int]
    error: str | None = None


@dataclass(frozen=True)
class Failure:
    """A prompt a run could not compute: where it came from, and why."""

    line: int
    reason: str
    error: str = "PromptError"
    stage: str = "tokenize"  # tokenize (before any compute), compute (on a worker), worker (its workers died)


@dataclass
class RunSummary:
    written: int = 0
    skipped_complete: int = 0
    duplicates: int = 0
    blank_lines: int = 0
    worst_error: float | None = None  # None: no prompt computed this run
    failed: dict[str, Failure] = field(default_factory=dict)  # by prompt id
    loads: dict[str, tuple[int, float]] = field(default_factory=dict)  # worker -> (model loads, seconds loading)

    def add_written(self, error: float) -> None:
        self.written += 1
        self.worst_error = error if self.worst_error is None else max(self.worst_error, error)


@dataclass
class RunPlan:
    prompts: PromptsFile
    spec: LoadSpec  # with its model resolved; pickled to every worker of a distributed run
    engine: Engine
    run: RunDescription  # the store's run description (identity and settings)
    targets: list[Target]  # layerwise targets (streamed engine)
    tasks: list[PromptTask]  # the unique prompts, in file order
    duplicates: int
    tee: BlockSink | None = None  # where each prompt pass's blocks also go (``detjac jacobian --out run.zarr``)

    def summary(self) -> RunSummary:
        return RunSummary(duplicates=self.duplicates, blank_lines=self.prompts.blank)

    def pending(self, store: StoreWriter, summary: RunSummary) -> list[PromptTask]:
        """The tasks whose prompt is not complete in ``store`` (in a ``--lens`` run: not committed, or not counted
        in the lens's sums at every layer); counts the others in ``summary``."""
        from .lens_run import uncounted

        done = set(store.prompt_ids())
        done -= uncounted(store, self.run, done)
        summary.skipped_complete = sum(t.pid in done for t in self.tasks)
        return [t for t in self.tasks if t.pid not in done]


def prepare_run(model_arg: str, prompts_path: str | Path | PromptsFile, spec: LoadSpec, *, row_block: int | None,
                max_tokens: int | None, keep: Keep | str, layers: str | None = None, components: str = "layer",
                mode: str = "auto", lenient: bool = False, load_device: str | None = None,
                lens: bool = False, engine: Engine | None = None, graph: GraphSettings | None = None,
                tee: BlockSink | None = None) -> RunPlan:
    """Read, load, tokenize and describe: everything checkable, before any store is touched.

    With ``lenient=False`` a prompt the tokenizer refuses, or one longer than ``max_tokens`` (or
    the model's context), raises PromptError and nothing runs; with ``lenient=True`` such a
    prompt becomes a task with its ``error`` set, to be recorded as failed while the others run.
    ``load_device`` loads the model somewhere else than ``spec.device`` (a distributed run's
    client plans on the CPU; its workers compute on their devices). ``lens``: a ``--lens`` run, whose ``layers``
    (default all) are the lens's and whose prompts store no layerwise Jacobian. ``graph``: a ``--graph`` run's
    settings, checked against the model once it is loaded.
    ``engine``: an engine the caller loaded already, used as it is; ``tee``: see :class:`RunPlan`.
    """
    from detjac.store import prompt_id

    prompts = prompts_path if isinstance(prompts_path, PromptsFile) else read_prompts(prompts_path)
    if lens:
        layers, components = layers or "all", "to_output"
    from detjac.engine import check_layerwise_request

    if layers is not None:
        check_layerwise_request(spec.model, components)
    # an engine the caller loaded already (``detjac jacobian --out``): used as it is
    engine = load_for(spec, load_device) if engine is None else engine
    if graph is not None:  # a family without neuron definitions is refused before any store is touched
        from detjac.graphs import check_graph

        check_graph(engine, graph)
    targets: list[Target] = []
    if layers is not None:
        from detjac.targets import layer_targets

        targets = layer_targets(layers, components, engine.n_layers)
    limit = min(max_tokens or engine.context, engine.context)
    tokenized = tokenize_each(prompts, engine.prompt_model(), engine.tokenizer, limit)
    if not lenient:
        check_tokenized(prompts, tokenized, limit)
    model_dir = spec.model.source  # a folder or a GGUF file
    lens_settings = None
    if lens:  # the lens layers' to_output rows are summed, never stored
        from .lens_run import lens_description

        lens_settings, targets = lens_description(targets), []
    if row_block is not None:  # a block cannot hold more rows than there are (zarr refuses such a chunk shape)
        row_block = min(row_block, engine.d_model)
    run = describe_run(engine, model_arg, model_dir, spec.model.revision, spec.dtype,
                       row_block, limit, keep,
                       None if engine.convention == engine.family.conventions[0] else engine.convention,
                       hub=spec.model.kind == "hub")
    # the weight and tokenizer files' SHA-256s are part of the run's identity, as are the lens settings (None: no lens)
    run = replace(run, fingerprint=weights_identity(model_dir), lens=lens_settings, graph=graph,
                  streamed=StreamedSettings(tuple(t.name for t in targets), spec.quantize, mode, spec.max_memory)
                  if spec.streamed_engine else None)
    tasks: dict[str, PromptTask] = {}
    duplicates = 0
    for item, tok in zip(prompts.prompts, tokenized, strict=True):
        pid = prompt_id(run.as_dict(), item.text)
        if pid in tasks:
            duplicates += 1
        else:
            tasks[pid] = PromptTask(pid, item, tok.ids, tok.error)
    return RunPlan(prompts, spec, engine, run, targets, list(tasks.values()), duplicates, tee)


def open_run_store(plan: RunPlan, out: str | Path, force_new: bool = False) -> Any:
    """Create the run's store at ``out`` (with the model's decoding matrices), or resume it; holds its lock."""
    from detjac.errors import StoreMismatchError
    from detjac.store import create_store, open_store

    try:
        return create_store(out, plan.run.as_dict(), force_new=force_new,
                            model_data=lambda: model_for_decoding(plan.engine, plan.spec))
    except StoreMismatchError as exc:
        from .lens_run import check_lens_store

        stored = open_store(out).run
        check_lens_store(stored, plan.run.as_dict(), out)
        named = [f"{what} files that differ: {files}." for what, key in (("Weight", "weights"),
                                                                             ("Tokenizer", "tokenizer"))
                 if (files := weights_difference(stored, plan.run.as_dict(), key)) is not None]
        said = setting_differences(stored, plan.run.as_dict())
        words = [f"In the settings you give: {'; '.join(said)}."] if said else []
        advice = " Use --force-new to replace it, or another --out."  # the store's closing advice stays last
        raise StoreMismatchError(" ".join([str(exc).removesuffix(advice), *named, *words]) + advice) from None


def write_one(engine: Engine, store: StoreWriter, task: PromptTask, run: RunDescription, targets: list[Target],
              bar: Any, progress: bool = True, sums: Any = None, tee: BlockSink | None = None) -> float:
    """Compute one prompt and commit it to ``store`` (a ``--lens`` run's blocks then go into ``sums``; ``tee``: a
    sink its blocks also go to, as ``detjac jacobian --out run.zarr`` keeps the Jacobian it prints); returns its
    reconstruction error."""
    return write_prompt(store, engine, task.pid, task.item, task.ids, run, targets, bar, progress, sums, tee)


def model_for_decoding(engine: Engine, spec: LoadSpec) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The embedding and unembedding matrices (row readers where the engine streams), the final norm's gain and the
    tokenizer file, kept in the store for decoding."""
    import torch

    from detjac.store import storage_dtype

    storage = getattr(torch, storage_dtype(spec.dtype))
    arrays = engine.decoding_rows(storage)
    tok_file = None if spec.model.is_gguf else spec.model.source / "tokenizer.json"
    if tok_file is not None and tok_file.is_file():
        return arrays, {"tokenizer.json": tok_file.read_bytes()}
    backend = getattr(engine.tokenizer, "backend_tokenizer", None)  # a GGUF's, built from its metadata
    return arrays, {"tokenizer.json": backend.to_str().encode()} if backend is not None else {}
