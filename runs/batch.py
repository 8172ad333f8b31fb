"""One prompt through the engine into a store: its row blocks streamed into a staged group that
becomes visible only when complete (see ``store/zarr_store.py``), and the run's description.

Used by both ways of running a corpus: one process (``runs/local.py``) and the workers of a
dask.distributed cluster (``runs/cluster.py``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from detjac import __version__
from detjac.errors import LinearizationError

from .prompts import PromptLine

LOW_RANK_PASSES = 3  # sweeps of the row stream per prompt in low-rank mode (2 power iterations)


def parse_keep(keep: str) -> int | None:
    """``full`` -> None; ``rank:K`` -> K (a positive integer); anything else is an error."""
    from detjac.errors import InvalidArgumentError

    if keep == "full":
        return None
    kind, _, value = keep.partition(":")
    if kind == "rank" and value.isdigit() and int(value) > 0:
        return int(value)
    raise InvalidArgumentError(f"Expected --keep full or --keep rank:K with K a positive integer. Got {keep!r}.")


def run_description(model: Any, model_arg: str, model_dir: Path | None, revision: str | None, dtype: str,
                    row_block: int, max_tokens: int, keep: str = "full", detach: bool = True) -> dict[str, Any]:
    """What identifies the run (checked when resuming) plus its other settings."""
    from detjac.engine import family_for

    config_file = model_dir / "config.json" if model_dir is not None else None
    config_sha = (hashlib.sha256(config_file.read_bytes()).hexdigest()
                  if config_file is not None and config_file.is_file()
                  else hashlib.sha256(model.config.to_json_string().encode()).hexdigest())
    family = family_for(model.config)
    return {"model_id": model_dir.name if model_dir is not None else model_arg,
            "model_path": str(model_dir.resolve()) if model_dir is not None else model_arg,
            "revision": revision, "model_type": model.config.model_type, "config_sha256": config_sha,
            "dtype": dtype, "keep": keep, "detach": detach, "position": family.default_position, "target": "hidden",
            "family": family.name, "detach_rules": family.describe() if detach else [], "row_block": row_block,
            "max_tokens": max_tokens, "detjac_version": __version__}


def write_prompt(store: Any, model: Any, tokenizer: Any, pid: str, item: PromptLine, ids: list[int],
                 run: dict[str, Any], bar: Any) -> float:
    """Stream one prompt's Jacobian into ``store``; returns its reconstruction error."""
    from detjac.engine import output_logits, stream_jacobian

    stream = stream_jacobian(model, ids, row_block=run["row_block"], detach=run["detach"], position=run["position"])
    storage = storage_dtype(run["dtype"])
    rank = parse_keep(run["keep"])
    with store.begin(pid, n_rows=stream.n_rows, n_tokens=len(ids), n_cols=stream.embeddings.shape[-1],
                     dtype=storage, row_block=run["row_block"], rank=rank) as writer:
        if rank is None:
            error = _stream_full(stream, writer, storage, bar)
            extra: dict[str, Any] = {}
        else:
            error, extra = _stream_low_rank(stream, writer, rank, run.get("passes", LOW_RANK_PASSES), bar)
        if run["detach"]:
            _check_exact(error, run["dtype"], item)
        _write_small(writer, stream.embeddings, stream.output, ids, storage, stream.bias)
        next_id = int(output_logits(model, stream.output).argmax())
        affine = {"affine": True} if stream.bias is not None else {}
        writer.commit({**_prompt_attrs(tokenizer, item, ids, next_id, error, run, storage), **extra, **affine})
    return error


class _OutputRows:
    """The streamed engine's row blocks of the final Jacobian, iterable again (low-rank mode sweeps it)."""

    def __init__(self, sm: Any, trace: Any, plan: Any) -> None:
        from detjac.engine.streamed import Target

        self.sm, self.trace, self.plan, self.target = sm, trace, plan, Target(-1, "output")
        self.n_rows, self.n_blocks = sm.d_model, plan.n_row_blocks
        self.embeddings, self.output = trace.embeddings, trace.output

    def __iter__(self) -> Any:
        return self.sm.blocks(self.trace, [self.target], self.plan)


def write_streamed_prompt(store: Any, sm: Any, pid: str, item: PromptLine, ids: list[int], run: dict[str, Any],
                          targets: list[Any], bar: Any, progress: bool = True) -> float:
    """One prompt through the layer-streamed engine: the final Jacobian and every layerwise ``targets``
    Jacobian, block by block into ``store``; returns the final Jacobian's reconstruction error. ``progress``
    shows the engine's own bars (forward pass, sweeps)."""
    import torch

    from detjac.engine import relative_error
    from detjac.engine.streamed import Target
    from detjac.store import LayerwiseSpec

    storage = storage_dtype(run["dtype"])
    rank = parse_keep(run["keep"])
    trace = sm.trace(ids, progress=progress)
    output = Target(-1, "output")
    auto_rows = run.get("row_block") in (None, "auto")
    plan = sm.plan(trace, [output, *targets], mode="reverse" if rank is not None else run.get("mode", "auto"),
                   row_block=None if auto_rows else run["row_block"])
    next_id = int(sm.logits(trace.output).argmax())
    n, d = len(ids), sm.d_model
    if rank is not None:
        with store.begin(pid, n_rows=d, n_tokens=n, n_cols=d, dtype=storage, row_block=plan.row_block,
                         rank=rank, shard_bytes=_shard_bytes(sm)) as writer:
            error, extra = _stream_low_rank(_OutputRows(sm, trace, plan), writer, rank,
                                            run.get("passes", LOW_RANK_PASSES), bar)
            if run["detach"]:
                _check_exact(error, run["dtype"], item)
            _write_small(writer, trace.embeddings, trace.output, ids, storage)
            writer.commit({**_prompt_attrs(sm.tokenizer, item, ids, next_id, error, run, storage), **extra})
        return error
    specs = {t.name: LayerwiseSpec(t.layer, t.component, t.local, "forward" if t in plan.forward else "reverse",
                                   plan.token_block) for t in targets}
    recon = {t: torch.zeros_like(trace.value(t)) for t in [output, *targets]}
    with store.begin(pid, n_rows=d, n_tokens=n, n_cols=d, dtype=storage, row_block=plan.row_block,
                     layerwise=specs, shard_bytes=_shard_bytes(sm)) as writer:
        bar.reset(total=plan.n_row_blocks * len(plan.reverse) + plan.n_token_blocks * len(plan.forward))
        for b in sm.blocks(trace, [output, *targets], plan, progress=progress):
            x = trace.source(b.target)[b.token_start:b.token_stop]
            recon[b.target][b.start:b.stop] += torch.einsum("rtc,tc->r", b.values, x)
            name = "jacobian" if b.target == output else b.target.name
            writer.write_block(name, b.start, b.stop, b.token_start, b.token_stop, _numpy(b.values, storage))
            bar.update()
        errors = {t: relative_error(recon[t], trace.value(t)) for t in recon}
        for t, e in errors.items():
            if run["detach"]:
                _check_exact(e, run["dtype"], item, t.name)
            if t != output:
                writer.write_layerwise(t.name, "output", _numpy(trace.value(t), storage))
                if t.local:
                    writer.write_layerwise(t.name, "inputs", _numpy(trace.source(t), storage))
        _write_small(writer, trace.embeddings, trace.output, ids, storage)
        layerwise = {t.name: {"reconstruction_error": errors[t], "mode": specs[t.name].mode} for t in targets}
        writer.commit({**_prompt_attrs(sm.tokenizer, item, ids, next_id, errors[output], run, storage),
                       "layerwise": layerwise, "stream": {"row_block": plan.row_block,
                                                          "token_block": plan.token_block,
                                                          "bytes_read": sm.stats.bytes_read}})
    return errors[output]


def _shard_bytes(sm: Any) -> int | None:
    """Under a CPU memory budget, jacobian shards of at most 1/64 of it (the writer holds up to one shard and
    zarr about two more while it writes one); None: the store's default."""
    from detjac.store.format import SHARD_BYTES

    budget = sm.budgets.get("cpu")
    return None if budget is None else max(1, min(SHARD_BYTES, budget // 64))


def _write_small(writer: Any, embeddings: Any, output: Any, ids: list[int], storage: str, bias: Any = None) -> None:
    writer.write_array("embeddings", _numpy(embeddings, storage))
    writer.write_array("output", _numpy(output, storage))
    writer.write_array("token_ids", np.asarray(ids, dtype=np.int64))
    if bias is not None:  # an affine model: y = sum_k J_k x_k + bias
        writer.write_array("bias", _numpy(bias, storage))


def _stream_full(stream: Any, writer: Any, storage: str, bar: Any) -> float:
    """Row blocks to the writer as they come; the reconstruction is accumulated on the way."""
    import torch

    from detjac.engine import relative_error

    recon = torch.empty_like(stream.output)
    bar.reset(total=stream.n_blocks)
    for block in stream:
        recon[block.start:block.stop] = torch.einsum("rtc,tc->r", block.values, stream.embeddings)
        writer.write_rows(block.start, block.stop, _numpy(block.values, storage))
        bar.update()
    return relative_error(_plus_bias(recon, stream), stream.output)


def _plus_bias(recon: Any, stream: Any) -> Any:
    """``sum_k J_k x_k`` plus the offset of an affine model (streams without one have none)."""
    bias = getattr(stream, "bias", None)
    return recon + bias if bias is not None else recon


def _stream_low_rank(stream: Any, writer: Any, rank: int, passes: int, bar: Any) -> tuple[float, dict[str, Any]]:
    """``passes`` sweeps of the row stream through a subspace iteration; only the triplets are stored."""
    import torch

    from detjac.engine import relative_error
    from detjac.store.subspace import SubspaceIteration

    n, d = stream.embeddings.shape
    iteration = SubspaceIteration(stream.n_rows, n, d, rank, passes=passes)
    recon = torch.empty_like(stream.output)
    bar.reset(total=stream.n_blocks * passes)
    more = True
    while more:
        first_pass = iteration.pass_index == 0
        for block in stream:
            if first_pass:  # the rows are the same in every pass
                recon[block.start:block.stop] = torch.einsum("rtc,tc->r", block.values, stream.embeddings)
            iteration.update(block.start, block.stop, _numpy(block.values, "float64"))
            bar.update()
        more = iteration.end_pass()
    attrs = writer.write_triplets(*iteration.finish())
    return relative_error(_plus_bias(recon, stream), stream.output), {**attrs, "passes": passes}


def _check_exact(error: float, dtype: str, item: PromptLine, what: str = "") -> None:
    from detjac.engine.jacobian import FLOAT64_EXACTNESS_BOUND

    if dtype == "float64" and not error < FLOAT64_EXACTNESS_BOUND:
        of = f" of {what}" if what else ""
        raise LinearizationError(f"Prompt on line {item.line}: float64 reconstruction error{of} {error:.3e} is above "
                                 f"{FLOAT64_EXACTNESS_BOUND:.0e}; a nonlinearity escaped detaching.")


def _prompt_attrs(tokenizer: Any, item: PromptLine, ids: list[int], next_id: int, error: float,
                  run: dict[str, Any], storage: str) -> dict[str, Any]:
    from detjac.store.format import now

    return {"prompt": item.text, "line": item.line, "meta": item.meta, "n_tokens": len(ids), "token_ids": ids,
            "tokens": [tokenizer.decode([i]) for i in ids] if tokenizer else None, "reconstruction_error": error,
            "next_token_id": next_id, "next_token": tokenizer.decode([next_id]) if tokenizer else None,
            "detached": run["detach"], "dtype": run["dtype"], "storage_dtype": storage, "model_id": run["model_id"],
            "revision": run["revision"], "model_type": run["model_type"], "position": run["position"],
            "detach_rules": run["detach_rules"], "detjac_version": __version__, "written_at": now()}


def storage_dtype(dtype: str) -> str:
    """The dtype results are stored in: the compute dtype, but float32 for 16-bit ones (numpy has no bfloat16)."""
    return "float32" if dtype in ("bfloat16", "float16") else dtype


def _numpy(t: Any, storage: str) -> Any:
    import torch

    return t.detach().to(device="cpu", dtype=getattr(torch, storage)).numpy()
