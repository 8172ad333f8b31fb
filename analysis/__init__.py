"""Analyses of detached Jacobians on numpy / dask arrays (no torch): the façade of the analysis layer.

runs/, view/ and cli/ import these names from here (each module loads on first use). ``spectra``: singular
triplets, decoding and dimensionality of one stored operator; ``jobs``: those mapped over a store's prompts, results
kept in the store's analysis cache; ``layers``: the layerwise decomposition; ``compare``: detached against ordinary
Jacobians; ``graphs``: the neurons that recur across stored attribution graphs; ``plots``, ``view_plots``: matplotlib
figures; ``lens/``: the detached Jacobian lens. The reports behind
``detjac analyze``: ``decoded``, ``jobs.dims_report``, ``layer_report``, ``compare``, ``report``.
"""

from detjac.facade import lazy_exports

_EXPORTS = {
    "analysis_report": "report:report",
    "cached_spectrum": "jobs",
    "check_lens_target": "lens",
    "compare_report": "compare",
    "decode_report": "decoded",
    "decode_spectrum": "jobs",
    "dimensionality": "spectra",
    "dims_report": "jobs",
    "fit_lens": "lens:fit",
    "jacobian_image": "views",
    "largest_columns": "views",
    "layer_table": "layers",
    "layerwise_report": "layer_report:layer_report",
    "Lens": "lens",
    "lens_counted": "lens.lens_fit:counted",
    "lens_markdown": "lens:markdown",
    "lens_readings": "lens:readings",
    "LENS_VERSION": "lens",
    "load_lens": "lens",
    "low_rank_spectrum": "spectra",
    "plot_agreement": "lens",
    "plot_columns": "view_plots",
    "plot_jacobian_image": "view_plots",
    "plot_path": "view_plots",
    "plot_positions": "lens",
    "plot_spectra": "plots",
    "prompt_svds": "jobs:svd",
    "read_spectrum": "jobs",
    "read_svd": "jobs",
    "recurring_neurons": "graphs",
    "GraphNeurons": "graphs",
    "relative_spread": "lens",
    "require_full": "jobs",
    "RunningSums": "lens",
    "save_lens": "lens",
    "score_lens": "lens:score",
    "singular_path": "views",
    "Spectrum": "spectra",
    "singular_values": "spectra",
    "SpectrumPanel": "plots",
    "stored_svd": "spectra",
    "summarize_lens": "lens:summarize",
    "targets_heatmap": "layers",
    "token_rank": "lens",
    "token_texts": "jobs",
    "write_table": "jobs",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
