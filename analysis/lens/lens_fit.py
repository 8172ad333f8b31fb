"""Fitting the lens from a store: one Dask task per layer and chunk of prompts, each committing a sealed partial
sum, merged into ``lens/fitted``; resumable after a kill, never counting a prompt twice, run under the store's
writer lock. How and why: ``docs/lens.md`` ("How the fit runs", "Distributed runs"). Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from detjac.errors import InvalidArgumentError, StoreError
from detjac.targets import TO_OUTPUT, Target

from .jacobian_lens import lens_attrs, write_fitted

if TYPE_CHECKING:
    from detjac.store import StoredPrompt, StoreReader, StoreWriter

_log = logging.getLogger(__name__)
PARTIAL = "partial"  # lens/partial-<layer>-<digest>: sums over a set of prompts
DEFAULT_CHUNK = 32


def run_lens_layers(run: dict[str, Any]) -> list[int]:
    """The layers a ``detjac run --lens`` store's run accumulated the lens at ([] for any other store)."""
    return [int(layer) for layer in (run.get("lens") or {}).get("layers", [])]


def lens_layers(store: StoreReader, layers: Sequence[int] | None = None) -> list[int]:
    """The layers whose ``to_output`` Jacobians the store holds, or whose lens sums a ``--lens`` run accumulated
    (all, or the requested ``layers``; negative ones count from the end); InvalidArgumentError naming the
    ``detjac run`` options that store them."""
    stored = run_lens_layers(store.run) or sorted(Target.parse(t).layer for t in store.run.get("layerwise") or []
                                                  if Target.parse(t).component == TO_OUTPUT)
    if not stored:
        raise InvalidArgumentError(
            f"Expected to_output.L layerwise Jacobians in {store.path} (the lens averages dy/dh_L). Got "
            f"{', '.join(store.run.get('layerwise') or []) or 'no layerwise targets'}. Store them with "
            "`detjac run MODEL PROMPTS --out STORE --layers all --components to_output`, or accumulate the lens "
            "while running with `detjac run MODEL PROMPTS --out STORE --lens` (--ordinary for the ordinary-Jacobian "
            "lens).")
    if layers is None:
        return stored
    n_layers = max(stored) + 1 if store.run.get("n_layers") is None else int(store.run["n_layers"])
    wanted = sorted({Target(layer if layer >= 0 else n_layers + layer, TO_OUTPUT).layer for layer in layers})
    missing = [layer for layer in wanted if layer not in stored]
    if missing:
        raise InvalidArgumentError(f"Expected layers with stored to_output targets ({', '.join(map(str, stored))}). "
                                   f"Got {', '.join(map(str, missing))}.")
    return wanted


def same_position_operator(prompt: StoredPrompt, layer: int) -> np.ndarray:
    """``T_p = dy_p / dh_{L,p}`` (d, d) in float64: the target position's block of the prompt's ``to_output.L``."""
    J = prompt.layerwise(f"{TO_OUTPUT}.{layer}")  # lazy (row, token, col): only the chunks holding token p are read
    p = int(prompt.attrs.get("position", -1)) % prompt.n_tokens
    return np.asarray(J[:, p, :], dtype=np.float64)


def _digest(ids: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps(sorted(ids)).encode()).hexdigest()[:16]


def partial_name(layer: int, ids: Sequence[str]) -> str:
    return f"{PARTIAL}-{layer}-{_digest(ids)}"


def fit_partial(location: str, layer: int, ids: Sequence[str]) -> str:
    """One task: the sums of ``T_p`` and ``T_p ⊙ T_p`` over ``ids`` at ``layer``, committed as a sealed partial."""
    from detjac.store import open_store

    store = open_store(location)
    total = square = None
    for pid in ids:
        T = same_position_operator(store.get(pid), layer)
        total = T.copy() if total is None else total + T
        square = T * T if square is None else square + T * T
    return write_partial(store, layer, ids, total, square)


def write_partial(store: StoreWriter, layer: int, ids: Sequence[str], total: np.ndarray, square: np.ndarray) -> str:
    """Commit the sums ``total`` (Σ T_p) and ``square`` (Σ T_p ⊙ T_p) over ``ids`` at ``layer`` as a sealed partial;
    returns its name (the ids' digest: the same prompts give the same name, so a rewrite replaces, never adds)."""
    name = partial_name(layer, ids)
    store.write_lens(name, {"sum": total, "sum_sq": square},
                     {"layer": layer, "count": len(ids), "prompt_ids": sorted(ids)},
                     {"sum": ("row", "col"), "sum_sq": ("row", "col")})
    return name


def partials(store: StoreWriter, layer: int, valid: set[str]) -> list[tuple[str, list[str]]]:
    """Partials of ``layer`` to use: (name, prompt ids), disjoint, every id among ``valid`` (the store's prompts);
    the widest first, so a merged partial wins over the ones it replaced if a kill left both."""
    found = []
    prefix = f"{PARTIAL}-{layer}-"
    for name in store.lens_names():
        if name.startswith(prefix):
            ids = store.read_lens(name, arrays=False)[1].get("prompt_ids") or []
            if set(ids) <= valid and name == partial_name(layer, ids):
                found.append((name, list(ids)))
    found.sort(key=lambda item: (-len(item[1]), item[0]))
    used: set[str] = set()
    chosen: list[tuple[str, list[str]]] = []
    for name, ids in found:
        if used.isdisjoint(ids):
            chosen.append((name, ids))
            used.update(ids)
        elif not any(set(ids) <= set(wider) for _, wider in chosen):  # not a merged partial's leftover source
            other, wider = next((n, w) for n, w in chosen if not set(w).isdisjoint(ids))
            twice = sorted(set(ids) & set(wider))
            if store.writable:  # this process holds the store: drop the narrower one; its other prompts are redone
                _log.warning("lens partial %s overlaps %s (%d prompt(s) counted in both, from writers that ran at "
                             "once before fits took the writer lock): removed; the prompts only it counted are "
                             "computed again", name, other, len(twice))
                store.remove_lens(name)
                continue
            raise StoreError(
                f"Expected disjoint lens partial sums of layer {layer} in {store.path}/lens. Got {name} and {other}, "
                f"which both count {len(twice)} prompt(s) ({', '.join(twice[:3])}{', ...' if len(twice) > 3 else ''})"
                ": they would be counted twice. `detjac lens fit STORE` repairs this (it removes the narrower one "
                "and computes the prompts only it counted; for a --lens store it then asks for the same `detjac "
                "run ... --lens` command again, which recomputes them).")
    return chosen


def lens_counted(store: StoreWriter, layers: Sequence[int], valid: set[str]) -> set[str]:
    """The prompts among ``valid`` that partials count at every one of ``layers``."""
    out = set(valid)
    for layer in layers:
        out &= {pid for _, got in partials(store, layer, valid) for pid in got}
    return out


def pending_tasks(store: StoreWriter, layers: Sequence[int], ids: Sequence[str],
                  chunk: int) -> list[tuple[int, list[str]]]:
    """(layer, prompt ids) chunks that no partial covers yet."""
    valid = set(ids)
    tasks = []
    for layer in layers:
        covered = {pid for _, got in partials(store, layer, valid) for pid in got}
        todo = [pid for pid in ids if pid not in covered]
        tasks += [(layer, todo[i:i + chunk]) for i in range(0, len(todo), chunk)]
    return tasks


def run_tasks(location: str, tasks: Sequence[tuple[int, list[str]]], progress: Any = None) -> None:
    """Every task through dask: on the active distributed client if there is one (results as they complete),
    else one at a time in this process. ``progress`` (tqdm-like) is updated per task."""
    import dask

    delayed = [dask.delayed(fit_partial, pure=False)(location, layer, ids) for layer, ids in tasks]
    client = _client()
    if client is None:
        for task in delayed:
            task.compute(scheduler="sync")
            _tick(progress)
        return
    from distributed import as_completed

    for future in as_completed(client.compute(delayed)):
        future.result()  # re-raises a task's error here
        _tick(progress)


def _client() -> Any:
    try:
        from distributed import get_client
    except ImportError:
        return None
    try:
        return get_client()
    except ValueError:  # no client active
        return None


def _tick(progress: Any) -> None:
    if progress is not None:
        progress.update()


def merge(store: StoreWriter, layer: int, valid: set[str]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Sum of the chosen partials of ``layer`` (one read at a time), the sum of squares and the ids covered;
    the partials are then replaced by one merged partial."""
    chosen = partials(store, layer, valid)
    if not chosen:
        raise StoreError(f"Expected partial sums of layer {layer} in {store.path}/lens. Got none.")
    total = square = None
    ids: list[str] = []
    for name, got in chosen:
        arrays = store.read_lens(name)[0]
        total = arrays["sum"] if total is None else total + arrays["sum"]
        square = arrays["sum_sq"] if square is None else square + arrays["sum_sq"]
        ids += got
    merged = partial_name(layer, ids)
    if len(chosen) > 1:
        write_partial(store, layer, ids, total, square)
    for name in store.lens_names():  # partials of this layer that the merged one covers (or that went stale)
        if name.startswith(f"{PARTIAL}-{layer}-") and name != merged:
            store.remove_lens(name)
    return total, square, sorted(ids)


def check_counted(store: StoreWriter, layers: Sequence[int], ids: Sequence[str]) -> None:
    """InvalidArgumentError unless partials count every prompt of a ``--lens`` store at every one of ``layers``."""
    missing = sorted(set(ids) - lens_counted(store, layers, set(ids)))
    if missing:
        raise InvalidArgumentError(
            f"Expected every prompt of the --lens store {store.path} counted in its lens sums. Got {len(missing)} of "
            f"{len(ids)} not counted ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): the run was "
            "stopped before it wrote their sums. Run the same `detjac run ... --lens` command again: it recomputes "
            "them.")


def fit_lens(store: StoreWriter, layers: Sequence[int] | None = None, *, chunk: int = DEFAULT_CHUNK,
        progress: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Fit the lens of ``store`` (see the module docstring) and write it to ``lens/fitted``.

    Parameters
    ----------
    store : ZarrStore
        A store with ``to_output`` layerwise targets (opened with :func:`detjac.store.open_store`).
    layers : sequence of int or None
        Layers to fit (default: every stored one).
    chunk : int
        Prompts per task (and per committed partial).
    progress : callable or None
        ``progress(total_tasks)`` returns a tqdm-like bar updated once per task.

    Returns
    -------
    dict
        ``{"layers", "count", "tasks", "reused"}``: the layers fitted, prompts per layer, tasks computed now,
        and prompts whose partial sums a previous (interrupted) fit had committed.
    """
    if chunk < 1:
        raise InvalidArgumentError(f"Expected a chunk of at least one prompt. Got {chunk}.")
    picked = lens_layers(store, layers)
    with store.writing():  # no run or other fit writes partials meanwhile (StoreError naming it if one does)
        return _fit(store, picked, chunk, progress)


def _fit(store: StoreWriter, picked: list[int], chunk: int, progress: Callable[[int], Any] | None) -> dict[str, Any]:
    ids = store.prompt_ids()
    if not ids:
        raise InvalidArgumentError(f"Expected prompts in {store.path} to fit a lens on. Got none.")
    if run_lens_layers(store.run):  # the run accumulated the sums: nothing to compute, only partials to merge
        check_counted(store, picked, ids)
        tasks = []
    else:
        tasks = pending_tasks(store, picked, ids, chunk)
    bar = progress(len(tasks)) if progress is not None else None
    try:
        run_tasks(str(store.path), tasks, bar)
    finally:
        if bar is not None:
            bar.close()
    valid = set(ids)
    means, seconds, counts = [], [], []
    covered = None
    for layer in picked:
        total, square, got = merge(store, layer, valid)
        means.append(total / len(got))
        seconds.append(square / len(got))
        counts.append(len(got))
        covered = got if covered is None else covered
    write_fitted(store, np.array(picked), np.stack(means), np.stack(seconds), np.array(counts),
                 lens_attrs(store, covered or []))
    done = sum(len(t[1]) for t in tasks)
    return {"layers": picked, "count": counts, "tasks": len(tasks),
            "reused": len(ids) * len(picked) - done}
