"""``detjac lens apply`` and ``detjac lens evaluate``'s work, one call each, on lenses read by role (``{"detached
lens": ..., "ordinary lens": ...}``, checked by :func:`~detjac.runs.check_lens_kinds` before the model loads): load
the lens's own model (float64, layer-streamed: :data:`~detjac.runs.lens_apply.LENS_LOAD`),
decode or evaluate, and write what was asked. The commands print what these return."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detjac.errors import InvalidArgumentError

from .lens_apply import (
    LENS_LOAD,
    check_lens_model,
    evaluate_lenses,
    position_ranks,
    recorded_model,
    score_prompt,
    unembedding,
)

if TYPE_CHECKING:
    from detjac.engine import Engine, ModelRef
    from detjac.model_settings import LoadSpec

HELDOUT = "benchmarks/data/heldout_prompts.txt"  # the default model's held-out dictionary entries, in the repository


@dataclass
class LensReading:
    """What :func:`apply_lens` read: the engine (its tokenizer decodes the ids), the rows (per layer and method: the
    rank of the model's own prediction, the relative error of the output read, its top token ids), the prompt's
    states and the plot written (or None)."""

    engine: Engine
    rows: list[dict[str, Any]]
    states: Any  # detjac.runs.lens_apply.PromptStates
    plot: Path | None = None


def apply_lens(lenses: dict[str, Any], prompt: str, spec: LoadSpec, *, model: ModelRef | None = None,
               resolve: Any = None, exact: bool = True, plot: str | None = None, token_text: Any = None
               ) -> LensReading:
    """``detjac lens apply``: ``prompt``'s layer states decoded through ``lenses``, beside the logit lens and, with
    ``exact``, the prompt's own exact map. ``model`` None: the model the lens records, else the default model
    (``resolve(name)`` turns that name into a model reference; default ``ModelRef.of``). ``plot``: layer x position
    heatmaps of the rank of the model's prediction, with ``token_text(tokenizer, id)`` labelling the positions."""
    from detjac.analysis import plot_positions
    from detjac.engine import ModelRef, load_engine

    if model is None:
        model = (resolve or ModelRef.of)(recorded_model(next(iter(lenses.values()))) or "default")
    engine = check_lens_model(load_engine(replace(spec, model=model, **LENS_LOAD)), list(lenses.values()))
    layers = [int(x) for x in next(iter(lenses.values())).layers]
    W_U = unembedding(engine)
    states, rows = score_prompt(engine, lenses, prompt, W_U, layers, exact)
    reading = LensReading(engine, rows, states)
    if plot:
        tokens = [token_text(engine.tokenizer, t) for t in states.token_ids]
        reading.plot = plot_positions(position_ranks(lenses, states, W_U, layers), layers, tokens, plot, prompt)
    return reading


@dataclass
class LensEvaluation:
    """What :func:`evaluate_lens` found: the per-prompt rows, the summary per layer and method, its markdown table,
    and the files written into ``out`` (empty without it)."""

    rows: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    table: str
    written: list[Path]


def heldout_prompts(model: str) -> str:
    """The default model's held-out prompts (in the repository), for ``lens evaluate`` without ``--prompts``."""
    found = Path(__file__).resolve().parents[1] / HELDOUT
    if model != "default" or not found.is_file():
        raise InvalidArgumentError(f"Expected --prompts (held-out prompts, one per line). Got none, and {HELDOUT} is "
                                   "only the default model's.")
    return str(found)


def evaluate_lens(lenses: dict[str, Any], model: ModelRef, prompts_path: str, *, device: str = "cpu",
                  limit: int | None = None, exact: int | None = None, out: str | None = None) -> LensEvaluation:
    """``detjac lens evaluate``: per layer, top-1 / top-10 agreement with the model's own prediction and the relative
    error of the output read over the first ``limit`` prompts of ``prompts_path`` (the exact map for the first
    ``exact``), for each of ``lenses``, the logit lens and the exact map; ``out`` (checked by the caller): a folder for
    lens_rows.csv, lens_summary.csv, lens_summary.md and lens_agreement.png."""
    from detjac.analysis import lens_markdown, plot_agreement, summarize_lens, write_table
    from detjac.engine import load_engine
    from detjac.outputs import write_output
    from detjac.progress import tqdm

    from .prompts import read_prompts

    prompts = [p.text for p in read_prompts(prompts_path, "txt").prompts][:limit]
    engine = check_lens_model(load_engine(model, device=device, **LENS_LOAD), list(lenses.values()))
    layers = [int(x) for x in next(iter(lenses.values())).layers]
    with tqdm(total=len(prompts), desc="lens evaluate", unit="prompt") as bar:
        rows = evaluate_lenses(engine, lenses, prompts, layers, exact=exact, progress=bar)
    summary = summarize_lens(rows)
    done = LensEvaluation(rows, summary, lens_markdown(summary), [])
    if out:
        folder = Path(out)
        title = f"{len(prompts)} prompts of {Path(prompts_path).name}"
        done.written = [write_table([{**r, "top": " ".join(map(str, r["top"]))} for r in rows],
                                    folder / "lens_rows.csv"),
                        write_table(summary, folder / "lens_summary.csv"),
                        write_output(folder / "lens_summary.md", done.table + "\n"),
                        plot_agreement(summary, folder / "lens_agreement.png", title)]
    return done
