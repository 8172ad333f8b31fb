"""A corpus run in one process: the prompts one after another, with a bar for prompts and one for blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lens_run import DEFAULT_FLUSH, running_sums
from .plan import PromptTask, RunPlan, RunSummary, write_one

if TYPE_CHECKING:
    from detjac.store import StoreWriter


def run_local(plan: RunPlan, store: StoreWriter, tasks: list[PromptTask], summary: RunSummary,
              lens_flush: int = DEFAULT_FLUSH) -> RunSummary:
    """Compute and commit every task in this process (the model ``plan`` loaded); counts go to ``summary``. A
    ``--lens`` run's sums are flushed every ``lens_flush`` prompts and when the loop ends, interrupted or not."""
    from detjac.progress import tqdm

    if not tasks:  # nothing to compute: no bar counting nothing
        return summary
    sums = running_sums(plan.run, lens_flush)
    try:
        with tqdm(total=len(tasks), desc="prompts", unit="prompt") as outer, \
                tqdm(desc="blocks", unit="block", leave=False) as inner:
            for task in tasks:
                error = write_one(plan.engine, store, task, plan.run, plan.targets, inner, sums=sums, tee=plan.tee)
                summary.add_written(error)
                outer.set_postfix(error=f"{error:.1e}")
                outer.update()
    finally:
        if sums is not None:
            sums.flush()  # the committed prompts are counted (a kill -9 skips this: they are recomputed)
    return summary
