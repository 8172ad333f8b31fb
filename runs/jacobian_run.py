"""``detjac jacobian`` and ``detjac demo``'s work, one call each: load the model, compute the detached Jacobian of
each prompt with its exactness report (and the ordinary Jacobian, for contrast), decode its singular triplets, and
write what was asked (a ``.npz`` file, a store, a spectra plot). The commands print what these return."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detjac.engine import Engine, ModelRef
    from detjac.model_settings import LoadSpec

Note = Callable[[str], None]

# detjac demo's prompts without --prompt: dictionary entries, the register the shipped model was trained on.
DEMO_PROMPTS = (
    "Bread, n. An article of food made from flour or meal by",
    "Oak, n. (Bot.) Any tree or shrub of the genus Quercus. The oaks have",
    "Whale, n. (Zool.) Any aquatic mammal of the order",
)

# Measured by benchmarks/ordinary_cost.py on 2 quiet cores, 29 November (docs/performance.md): the ordinary pass over
# the detached one, "Kitten, n. A young" on the shipped model, 2.5 times in memory and 1.9 layer-streamed; the
# Llama-3.2-1B shape layer-streamed under cpu=1GiB, 17 tokens, 1.7 (289 s and 483 s).
ORDINARY_COSTS_MORE = ("Note: the ordinary Jacobian goes through torch.func, in memory more than twice the detached "
                       "pass's time (2.5 times on the shipped model); --no-ordinary skips it.")


@dataclass
class JacobianOutcome:
    """What :func:`prompt_jacobian` computed: the engine, the exactness report (its ``detached`` result and, unless
    skipped, its ``ordinary`` one), the top singular triplets of ``sum_k J_k`` decoded, and where the Jacobian went:
    ``written`` (a ``.npz`` file) or ``stored`` (the prompt's id in a store), else None."""

    engine: Engine
    report: Any  # detjac.engine.ExactnessReport
    summed: Any  # detjac.engine.DecodedOperator
    written: Path | None = None
    stored: str | None = None


def ordinary_costs_more(spec: LoadSpec, engine: Engine, ordinary: bool) -> bool:
    """Whether the ordinary pass will take more than twice the detached one: the detached pass goes by explicit pieces
    and the ordinary one through torch.func, in memory (layer-streamed, measured under twice:
    benchmarks/ordinary_cost.py)."""
    return ordinary and bool(engine.explicit_sweeps) and not spec.streamed_engine


def prompt_jacobian(spec: LoadSpec, model: ModelRef, prompt: str, *, row_block: int | None = None,
                    ordinary: bool = True, n_values: int = 5, top: int = 5, out: str | None = None,
                    force: bool = False, note: Note | None = None) -> JacobianOutcome:
    """``detjac jacobian``'s pipeline: the engine ``spec`` loads, the exactness report of ``prompt`` (with the ordinary
    Jacobian when ``ordinary``), the top ``n_values`` triplets of ``sum_k J_k`` decoded to ``top`` tokens, and ``out``
    (checked by the caller): a ``.npz`` file, else a store the prompt goes into by the run's own path (its blocks teed
    to the report, computed once). ``note`` receives, before the work starts, the line saying the ordinary pass costs
    more (:func:`ordinary_costs_more`)."""
    from detjac.engine import exactness_report, explain_summed, load_engine

    engine = load_engine(spec)
    if note is not None and ordinary_costs_more(spec, engine, ordinary):
        note(ORDINARY_COSTS_MORE)
    stored, detached = None, None
    npz = out is not None and out.lower().endswith(".npz")
    if out is not None and not npz:
        stored, detached = _store(out, model, prompt, row_block, engine, spec)
    rep = exactness_report(engine, prompt, row_block=row_block, ordinary=ordinary, progress=True, detached=detached)
    outcome = JacobianOutcome(engine, rep, explain_summed(rep.detached, engine, n_values, top), stored=stored)
    if npz:
        from .export import save_result

        outcome.written = save_result(rep.detached, out, model=model.name, tokens=rep.detached.tokens, force=force)
    return outcome


def _store(out: str, model: ModelRef, prompt: str, row_block: int | None, engine: Engine,
           spec: LoadSpec) -> tuple[str, tuple[Any, float] | None]:
    """The prompt into the store ``out`` by the run's own path, its blocks teed into a
    :class:`~detjac.engine.ResultSink`: its prompt id and (the detached Jacobian it stored, seconds), or None in their
    place when the store held the prompt already (the report then computes it)."""
    from detjac.engine import ResultSink

    from .run import RunOptions, run_one

    kept = ResultSink(engine, prompt)
    t0 = time.perf_counter()
    pid = run_one(model, prompt, out, RunOptions(load=spec, row_block=row_block), engine, tee=kept)
    return pid, (kept.result, time.perf_counter() - t0) if kept.result is not None else None


@dataclass
class DemoPrompt:
    """One prompt of :func:`demo_prompts`: its text, exactness report and decoded triplets
    (:func:`detjac.engine.explain`)."""

    text: str
    report: Any  # detjac.engine.ExactnessReport
    explanation: Any  # detjac.engine.Explanation


def demo_prompts(engine: Engine, prompts: Sequence[str], *, n_values: int = 3, top: int = 8) -> Iterator[DemoPrompt]:
    """``detjac demo``'s work, one prompt at a time (the command prints each as it comes): the exactness report with
    the ordinary Jacobian's contrast, and the top ``n_values`` triplets of the combined operator and of every
    ``J_k``, decoded to ``top`` tokens. No prompts: the shipped model's dictionary entries."""
    from detjac.engine import exactness_report, explain

    for text in prompts or DEMO_PROMPTS:
        rep = exactness_report(engine, text)
        yield DemoPrompt(text, rep, explain(rep.detached, engine, k=n_values, top=top))
