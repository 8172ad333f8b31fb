"""A corpus run in one process: the prompts one after another, with a bar for prompts and one for blocks."""

from __future__ import annotations

from typing import Any

from .plan import PromptTask, RunPlan, RunSummary, write_one


def run_local(plan: RunPlan, store: Any, tasks: list[PromptTask], summary: RunSummary) -> RunSummary:
    """Compute and commit every task in this process (the model ``plan`` loaded); counts go to ``summary``."""
    from detjac.progress import tqdm

    with tqdm(total=len(tasks), desc="prompts", unit="prompt") as outer, \
            tqdm(desc="blocks", unit="block", leave=False) as inner:
        for task in tasks:
            error = write_one(plan.loaded, store, task, plan.run, plan.targets, inner)
            summary.add_written(error)
            outer.set_postfix(error=f"{error:.1e}")
            outer.update()
    return summary
