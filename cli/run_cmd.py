"""``detjac run``: every prompt of a file into a store, in this process or on a dask.distributed cluster."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

DTYPES = ("float64", "float32", "bfloat16")
SHOWN_FAILURES = 20  # failed prompts listed at the end of a run (all are in the store)


@click.command()
@click.argument("model", type=click.Path())
@click.argument("prompts", type=click.Path())
@click.option("--out", "-o", required=True,
              help="Store folder (created, or resumed): a path or a file:// URL; with --scheduler, on a file system "
                   "every worker mounts at the same path.")
@click.option("--dtype", type=click.Choice(DTYPES), default="float64", show_default=True,
              help="Compute dtype; bfloat16 results are stored as float32.")
@click.option("--row-block", type=click.IntRange(min=1), default=None,
              help="Jacobian rows per vmapped pullback and per stored chunk [default: 64, or sized to --max-memory].")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Refuse prompts longer than this many tokens (default: the model's context); with --workers or "
                   "--scheduler they are recorded as failed instead and the others run.")
@click.option("--keep", default="full", show_default=True,
              help="full: the whole Jacobian; rank:K: only the top-K singular triplets of each token's J_k and of "
                   "[J_1 ... J_n], sketched in one pass over the streamed rows (for long prompts or big models).")
@click.option("--ordinary", is_flag=True,
              help="Store the ordinary Jacobian (nothing detached; it does not reconstruct the output), "
                   "for comparison with the detached one.")
@click.option("--layers", default=None,
              help="Also store layerwise Jacobians of these layers: all, or indices like 0,5,10 (negative counts "
                   "from the end). Implies --streamed.")
@click.option("--components", default="layer", show_default=True,
              help="With --layers: layer (the layer's output), attn, mlp (its attention / MLP contributions), "
                   "w.r.t. the input embeddings; add _local (layer_local, attn_local, mlp_local) for the same "
                   "w.r.t. the layer's own input.")
@click.option("--streamed", is_flag=True,
              help="Use the layer-streamed engine: one decoder layer's weights in memory at a time, read from "
                   "the checkpoint (for models larger than memory). Implied by --layers, --max-memory, --quantize.")
@click.option("--max-memory", default=None,
              help="Memory budget per device for the streamed engine, e.g. cpu=4GiB or cuda:0=8GiB,cpu=32GiB; "
                   "the row block is sized to fit.")
@click.option("--quantize", type=click.Choice(("nf4", "fp4", "int8")), default=None,
              help="Quantize a float checkpoint on load with bitsandbytes (pip install 'detjac[quant]'); the "
                   "Jacobian is that of the quantized model. bitsandbytes checkpoints are read as they are.")
@click.option("--mode", type=click.Choice(("auto", "reverse", "forward")), default="auto", show_default=True,
              help="Streamed engine: reverse (row blocks, vjp) or forward (token blocks, jvp) sweeps; auto picks "
                   "the cheaper by the cost model (see README).")
@click.option("--force-new", is_flag=True, help="Replace a store written for another model or settings.")
@click.option("--device", default="cpu", show_default=True,
              help="Torch device, e.g. cuda:0 (with --scheduler: each worker's own; dask-cuda gives each one GPU).")
@click.option("--revision", default=None, help="Checkpoint revision (for from_pretrained).")
@click.option("--trust-remote-code", is_flag=True, help="Allow the checkpoint's own Python code (off by default).")
@click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
              help="Spread the prompts over a LocalCluster of this many worker processes on this machine "
                   "(0: this process computes them all).")
@click.option("--scheduler", default=None,
              help="Spread the prompts over the workers of this dask.distributed scheduler, e.g. "
                   "tcp://10.0.0.5:8786; each worker loads the model once and writes into the shared store.")
@click.option("--memory-limit", default="auto", show_default=True,
              help="Memory limit per LocalCluster worker (--workers); auto shares this machine's memory.")
def run(model: str, prompts: str, out: str, **settings: Any) -> None:
    """Detached Jacobians of MODEL on every prompt of PROMPTS, streamed into a store.

    PROMPTS is a .txt file (one prompt per line) or a .jsonl file ({"prompt": ...} or
    {"text": ...} per line, other fields kept as metadata); blank lines are skipped. MODEL is a checkpoint
    folder or `default`. Each prompt's row blocks go to disk as they are computed and the
    prompt becomes visible only when complete. Re-running the same command after a crash
    or kill resumes: complete prompts are skipped, partial ones redone. Duplicate prompts
    are stored once.

    With --workers N or --scheduler ADDRESS the prompts go to dask.distributed workers: each
    loads the model once and commits its prompts into the same store, which ends identical
    to a run in one process. A prompt that cannot be run (too long, refused by the tokenizer,
    a failed exactness check) is recorded as failed in the store with its reason, and the
    others go on; a killed worker's prompt is redone by another worker; Ctrl-C stops cleanly
    and the same command resumes. Exit status: 0 every prompt stored, 3 some prompts failed
    (listed, and kept in the store), 130 interrupted, 1 an error. A second run on a store
    that a run is writing is refused, naming its process and host.

    \b
    Examples:
      detjac run default prompts.txt --out run.zarr
      detjac run ./Llama-3.2-1B prompts.jsonl --out llama.zarr --dtype float32 --row-block 128
      detjac run default long_prompts.txt --out lowrank.zarr --keep rank:16
      detjac run default prompts.txt --out ordinary.zarr --ordinary
      detjac run default prompts.txt --out layers.zarr --layers all --components layer,attn,mlp
      detjac run ./Qwen3-14B prompts.txt --out q.zarr --dtype bfloat16 --device cuda:0 --max-memory cuda:0=8GiB
      detjac run ./Llama-3.1-70B prompts.txt --out l.zarr --dtype bfloat16 --device cuda:0 --quantize nf4
      detjac run default prompts.txt --out run.zarr --workers 2
      detjac run /shared/Qwen3-8B corpus.jsonl --out file:///shared/q8.zarr --scheduler tcp://10.0.0.5:8786 \\
          --dtype bfloat16 --device cuda:0
    """
    from detjac.runs.batch import parse_keep

    parse_keep(settings["keep"])
    settings["detach"] = not settings.pop("ordinary")
    _run(model, prompts, out, **settings)


def _run(model_arg: str, prompts_path: str, out: str, *, dtype: str, row_block: int | None, max_tokens: int | None,
         keep: str, detach: bool, layers: str | None, components: str, streamed: bool, max_memory: str | None,
         quantize: str | None, mode: str, force_new: bool, device: str, revision: str | None,
         trust_remote_code: bool, workers: int, scheduler: str | None, memory_limit: str) -> None:
    from detjac.runs.plan import ModelSpec, open_run_store, prepare_run

    streamed = streamed or bool(layers or max_memory or quantize)
    _check_options(layers, components, keep, streamed, mode, workers, scheduler)
    distributed = scheduler is not None or workers > 0
    spec = ModelSpec(_model_ref(model_arg), dtype, device, streamed, detach, max_memory, quantize, revision,
                     trust_remote_code)
    # A distributed run's client plans on the CPU; the workers compute on --device.
    plan = prepare_run(model_arg, prompts_path, spec, row_block=row_block, max_tokens=max_tokens, keep=keep,
                       layers=layers, components=components, mode=mode, lenient=distributed,
                       load_device="cpu" if distributed else None)
    summary = plan.summary()
    interrupted = False
    with open_run_store(plan, out, force_new) as store:
        tasks = plan.pending(store, summary)
        refused = sum(t.error is not None for t in tasks)
        what = f" and {len(plan.targets)} layerwise Jacobians per prompt" if plan.targets else ""
        click.echo(f"{len(plan.prompts.prompts)} prompts in {prompts_path} ({plan.prompts.blank} blank lines "
                   f"skipped, {summary.duplicates} duplicates); {summary.skipped_complete} already in {out}; "
                   f"{len(tasks) - refused} to compute{what}"
                   + (f"; {refused} cannot be run (recorded as failed)." if refused else "."))
        if distributed:
            interrupted = _run_distributed(plan, store, tasks, summary, workers, scheduler, memory_limit)
        else:
            from detjac.runs.local import run_local

            run_local(plan, store, tasks, summary)
        total = len(store.prompt_ids())
    _echo_summary(summary, out, total, distributed)
    if interrupted:
        click.echo(f"interrupted: the prompts committed so far are in {out}; run the same command again to resume.")
        sys.exit(130)
    if summary.failed:
        sys.exit(3)


def _check_options(layers: str | None, components: str, keep: str, streamed: bool, mode: str, workers: int,
                   scheduler: str | None) -> None:
    from detjac.errors import InvalidArgumentError

    if layers is None and components != "layer":
        raise InvalidArgumentError(f"Expected --layers with --components. Got --components {components} alone.")
    if layers is not None and keep != "full":
        raise InvalidArgumentError(f"Expected --keep full with --layers (layerwise Jacobians are stored whole). "
                                   f"Got --keep {keep}.")
    if not streamed and mode != "auto":
        raise InvalidArgumentError(f"Expected --mode with the streamed engine (--streamed). Got --mode {mode} alone.")
    if scheduler is not None and workers:
        raise InvalidArgumentError(f"Expected either --scheduler (an existing cluster) or --workers (a LocalCluster). "
                                   f"Got both: --scheduler {scheduler} --workers {workers}.")


def _model_ref(model_arg: str) -> str:
    """A checkpoint folder as an absolute path (workers resolve it on their own file system); else unchanged."""
    path = Path(model_arg)
    return str(path.resolve()) if path.is_dir() else model_arg


def _run_distributed(plan: Any, store: Any, tasks: list[Any], summary: Any, workers: int, scheduler: str | None,
                     memory_limit: str) -> bool:
    """Run ``tasks`` on a cluster; returns True when interrupted (Ctrl-C), after cancelling what was queued."""
    from detjac.runs.cluster import run_on_cluster

    from .cluster import dask_client

    # LocalCluster workers share this machine's cores; a scheduler's workers keep their own thread settings.
    threads = max(1, len(os.sched_getaffinity(0)) // workers) if workers else None
    try:
        with dask_client(workers, scheduler, memory_limit, trim_memory=False) as client:
            run_on_cluster(client, plan, store, tasks, summary, torch_threads=threads, local=scheduler is None)
    except KeyboardInterrupt:
        return True
    return False


def _echo_summary(summary: Any, out: str, total: int, distributed: bool) -> None:
    failed = f"{len(summary.failed)} failed, " if distributed else ""
    click.echo(f"done: {summary.written} written, {summary.skipped_complete} already complete, {failed}"
               f"{summary.duplicates} duplicates, {summary.blank_lines} blank lines; {total} prompts in {out}; "
               f"worst reconstruction error this run {summary.worst_error:.2e}")
    if summary.loads:
        counts = sorted({n for n, _ in summary.loads.values()})
        seconds = sum(s for _, s in summary.loads.values()) / len(summary.loads)
        each = f"{counts[0]} each" if len(counts) == 1 else f"{counts[0]}-{counts[-1]} per worker"
        click.echo(f"model loads: {len(summary.loads)} workers, {each}, {seconds:.2f} s per worker on average")
    if summary.failed:
        click.echo(f"failed ({len(summary.failed)}; recorded in {out} under failed/, retried by the next run):")
        for pid, failure in list(summary.failed.items())[:SHOWN_FAILURES]:
            click.echo(f"  line {failure.line} ({pid}, {failure.stage}): {failure.reason}")
        if len(summary.failed) > SHOWN_FAILURES:
            click.echo(f"  ... and {len(summary.failed) - SHOWN_FAILURES} more: detjac store info {out}")
