"""Corpus runs: every prompt of a file through the engine into one store, resumable (``detjac run``), and the
other jobs that need both a model and a store (steering, the lens's fit and scores, exports).

The package is runs/'s façade: cli/ imports these names from here (each module loads on first use). The run's
path: ``run.run_corpus`` -> ``plan.prepare_run`` (model, tokens, :class:`~detjac.runs.description.RunDescription`)
-> ``local`` or ``cluster`` -> ``batch.write_prompt`` (one prompt's blocks into the store).
"""

from detjac.facade import lazy_exports

_EXPORTS = {
    "RunDescription": "description", "RunOptions": "run", "run_corpus": "run", "run_one": "run",
    "read_prompts": "prompts", "dask_scheduler": "scheduler", "check_npz_path": "export", "save_result": "export",
    "weights_identity": "fingerprint", "model_identity": "fingerprint", "load_concept": "steering",
    "steer_prompt": "steering",
    "prepare_evaluation": "steering", "evaluate_steering": "steering", "check_lens_kinds": "lens_apply",
    "load_lens_engine": "lens_apply", "fit_jlens": "lens_apply", "score_prompt": "lens_apply",
    "position_ranks": "lens_apply", "unembedding": "lens_apply", "evaluate_lenses": "lens_apply:evaluate",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
