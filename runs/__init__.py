"""Corpus runs: every prompt of a file through the engine into one store, resumable (``detjac run``), and the
other jobs that need both a model and a store (steering, the lens's fit and scores, exports).

The package is runs/'s façade: cli/ imports these names from here (each module loads on first use). The run's
path: ``run.run_corpus`` -> ``plan.prepare_run`` (model, tokens, :class:`~detjac.runs.description.RunDescription`)
-> ``local`` or ``cluster`` -> ``batch.write_prompt`` (one prompt's blocks into the store).
"""

from typing import TYPE_CHECKING

from detjac.facade import lazy_exports

if TYPE_CHECKING:  # the names as tools see them (type checkers, go-to-definition); imported lazily at run time
    from .description import RunDescription
    from .export import check_npz_path, save_result
    from .fingerprint import model_identity, weights_identity
    from .lens_apply import (
        check_lens_kinds,
        fit_jlens,
        load_lens_engine,
        position_ranks,
        recorded_model,
        score_prompt,
        unembedding,
    )
    from .lens_apply import evaluate as evaluate_lenses
    from .lens_artifact import artifact_lens, export_lens, hub_lens_file, read_lens
    from .prompts import check_prompts_path, read_prompts
    from .run import RunOptions, run_corpus, run_one
    from .scheduler import dask_scheduler
    from .steering import evaluate_steering, load_concept, prepare_evaluation, steer_prompt

_EXPORTS = {
    "RunDescription": "description", "RunOptions": "run", "run_corpus": "run", "run_one": "run",
    "read_prompts": "prompts", "check_prompts_path": "prompts", "dask_scheduler": "scheduler",
    "check_npz_path": "export", "save_result": "export",
    "weights_identity": "fingerprint", "model_identity": "fingerprint", "load_concept": "steering",
    "steer_prompt": "steering",
    "prepare_evaluation": "steering", "evaluate_steering": "steering", "check_lens_kinds": "lens_apply",
    "load_lens_engine": "lens_apply", "recorded_model": "lens_apply", "fit_jlens": "lens_apply",
    "score_prompt": "lens_apply",
    "position_ranks": "lens_apply", "unembedding": "lens_apply", "evaluate_lenses": "lens_apply:evaluate",
    "read_lens": "lens_artifact", "export_lens": "lens_artifact", "artifact_lens": "lens_artifact",
    "hub_lens_file": "lens_artifact",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
