"""A ``detjac run --lens`` run: the lens's sums accumulated while the prompts are computed, no operator stored.

:class:`SamePosition` keeps each prompt's target-position block of ``to_output.L`` from the output's reverse sweep; the
blocks go into running sums written as sealed partials, merged by :func:`finish`. Details: docs/lens.md,
"Accumulating the lens during a run"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from detjac.errors import InvalidArgumentError, StoreMismatchError
from detjac.targets import TO_OUTPUT, Target

if TYPE_CHECKING:
    from detjac.store import StoreWriter

    from .description import RunDescription

DEFAULT_FLUSH = 1  # prompts between two flushes of the sums (--lens-flush)


def lens_description(layers: list[Target]) -> dict[str, Any]:
    """The run attribute ``lens`` (part of the run's identity): the layers and the target averaged."""
    return {"layers": [t.layer for t in layers], "target": TO_OUTPUT}


def lens_targets(run: RunDescription) -> list[Target]:
    """The ``to_output`` targets whose same-position blocks a ``--lens`` run accumulates ([] for another run)."""
    return [Target(int(layer), TO_OUTPUT) for layer in (run.lens or {}).get("layers", [])]


class SamePosition:
    """One prompt's ``T_p`` per lens target, filled from the ``to_output`` row blocks as the sweep yields them."""

    def __init__(self, targets: list[Target], position: int, n_tokens: int, d_model: int) -> None:
        self.index = {t: i for i, t in enumerate(targets)}
        self.position = position % n_tokens
        self.blocks = np.zeros((len(targets), d_model, d_model))  # (layer, row, col) float64

    def take(self, block: Any) -> None:
        """Rows ``block.start:block.stop`` of ``T_p`` from a block of ``to_output`` rows (rows, tokens, col)."""
        import torch

        assert block.token_start <= self.position < block.token_stop, "to_output rows come in reverse mode"
        rows = block.values[:, self.position - block.token_start, :]
        self.blocks[self.index[block.target], block.start:block.stop] = rows.to("cpu", torch.float64).numpy()


def check_lens_store(stored: dict[str, Any], wanted: dict[str, Any], path: Any) -> None:
    """StoreMismatchError naming the option when a store written with ``--lens`` is resumed without it, or the
    other way round, or at other layers (the generic mismatch lists the differing identity keys)."""
    had, has = stored.get("lens"), wanted.get("lens")
    if had == has:
        return
    if not had or not has:
        made = "with --lens (it holds the lens's sums, no Jacobians)" if had else "without --lens"
        asked = "with --lens" if has else "without --lens"
        raise StoreMismatchError(f"Expected a store written {asked} to resume. Got {path}, written {made}. Use "
                                 "another --out (or --force-new to replace it).")
    raise StoreMismatchError(f"Expected the lens layers of the store {path} ({had['layers']}) to resume it. Got "
                             f"--layers giving {has['layers']}. Use the store's layers, another --out or --force-new.")


def uncounted(store: StoreWriter, run: RunDescription, ids: set[str]) -> set[str]:
    """The committed prompts among ``ids`` that some lens layer's partials do not count (all for a store whose run
    is not a --lens run: none)."""
    from detjac.analysis import lens_counted

    layers = [t.layer for t in lens_targets(run)]
    return ids - lens_counted(store, layers, ids) if layers and ids else set()


def finish(store: StoreWriter, run: RunDescription) -> dict[str, Any] | None:
    """Merge the partials into ``lens/fitted`` when every committed prompt is counted; returns the fit's report,
    or ``{"uncounted": n}`` (the run was interrupted or a worker died: run again), or None for another run."""
    from detjac.analysis import fit_lens

    ids = set(store.prompt_ids())
    if not lens_targets(run) or not ids:
        return None
    missing = uncounted(store, run, ids)
    if missing:
        return {"uncounted": len(missing)}
    return fit_lens(store)


def running_sums(run: RunDescription, flush_every: int) -> Any:
    """A process's :class:`~detjac.analysis.lens.lens_sums.RunningSums` for a ``--lens`` run (None for another run)."""
    from detjac.analysis import RunningSums

    layers = lens_targets(run)
    return RunningSums([t.layer for t in layers], flush_every) if layers else None


def check_flush(flush_every: int) -> int:
    if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
        raise InvalidArgumentError(f"Expected --lens-flush to be a positive number of prompts. Got {flush_every!r}.")
    return flush_every
