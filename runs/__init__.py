"""Corpus runs: every prompt of a file through the engine into one store, resumable (``detjac run``), and the
other jobs that need both a model and a store (steering, the lens's fit and scores, exports).

The package is runs/'s façade: cli/ imports these names from here (each module loads on first use). The run's
path: ``run.run_corpus`` -> ``plan.prepare_run`` (model, tokens, :class:`~detjac.runs.description.RunDescription`)
-> ``local`` or ``cluster`` -> ``batch.write_prompt`` (one prompt's blocks into the store).
"""

from typing import TYPE_CHECKING

from detjac.facade import lazy_exports

if TYPE_CHECKING:  # the façade's names, each once: read by type checkers and by lazy_exports (imported on first use)
    from .attention_run import attention_pages, attention_targets
    from .description import RunDescription
    from .export import save_result
    from .family_check import family_checks
    from .fingerprint import model_identity, weights_identity
    from .graph_run import graph_file
    from .interventions import Interventions, load_interventions
    from .jacobian_run import DemoPrompt, JacobianOutcome, demo_prompts, prompt_jacobian
    from .jlens_fit import fit_jlens_folder
    from .lens_apply import (
        LENS_LOAD,
        check_lens_kinds,
        check_lens_model,
        evaluate_lenses,
        fit_jlens,
        jlens_fitted_on,
        position_ranks,
        recorded_model,
        score_prompt,
        unembedding,
    )
    from .lens_artifact import artifact_lens, export_lens, hub_lens_file, read_lens
    from .lens_export import export_lens_file
    from .lens_use import LensEvaluation, LensReading, apply_lens, evaluate_lens, heldout_prompts
    from .neurons_run import NeuronOptions, build_neuron_index
    from .prompts import check_prompts_path, read_prompts
    from .run import RunOptions, run_corpus, run_one
    from .scheduler import ClusterOptions, dask_cluster
    from .steering import evaluate_steering, load_concept, prepare_evaluation, steer_prompt
    from .svd_run import SvdOutcome, SvdSettings, prompt_svd

__all__, __getattr__ = lazy_exports(__name__, __file__)
