"""Analyses of detached Jacobians on numpy / dask arrays (no torch): the façade of the analysis layer.

runs/, view/ and cli/ import these names from here (each module loads on first use). ``spectra``: singular
triplets, decoding and dimensionality of one stored operator; ``jobs``: those mapped over a store's prompts, results
kept in the store's analysis cache; ``layers``: the layerwise decomposition; ``compare``: detached against ordinary
Jacobians; ``graphs``: the neurons that recur across stored attribution graphs; ``plots``, ``view_plots``: matplotlib
figures; ``lens/``: the detached Jacobian lens. The reports behind
``detjac analyze``: ``decoded``, ``jobs.dims_report``, ``layer_report``, ``compare``, ``report``.
"""

from typing import TYPE_CHECKING

from detjac.facade import lazy_exports

if TYPE_CHECKING:  # the names as tools see them (type checkers, go-to-definition); imported lazily at run time
    from .compare import compare_report
    from .decoded import decode_report
    from .graphs import GraphNeurons, recurring_neurons
    from .jobs import (
        DecodedIds,
        SpectrumDecoder,
        cached_spectrum,
        decode_spectrum,
        dims_report,
        read_spectrum,
        read_svd,
        require_full,
        token_texts,
        write_table,
    )
    from .jobs import svd as prompt_svds
    from .layer_report import layer_report as layerwise_report
    from .layers import layer_table, targets_heatmap
    from .lens import (
        FINAL_BLOCK,
        LENS_VERSION,
        Lens,
        RunningSums,
        check_lens_target,
        lens_reading,
        load_lens,
        plot_agreement,
        plot_positions,
        relative_spread,
        save_lens,
        token_rank,
    )
    from .lens import fit as fit_lens
    from .lens import markdown as lens_markdown
    from .lens import readings as lens_readings
    from .lens import score as score_lens
    from .lens import summarize as summarize_lens
    from .lens.lens_fit import counted as lens_counted
    from .plots import SpectrumPanel, plot_spectra
    from .report import report as analysis_report
    from .spectra import Spectrum, dimensionality, low_rank_spectrum, singular_values, stored_svd
    from .view_plots import plot_columns, plot_jacobian_image, plot_path
    from .views import jacobian_image, largest_columns, singular_path

_EXPORTS = {
    "analysis_report": "report:report",
    "cached_spectrum": "jobs",
    "check_lens_target": "lens",
    "compare_report": "compare",
    "decode_report": "decoded",
    "decode_spectrum": "jobs",
    "DecodedIds": "jobs",
    "dimensionality": "spectra",
    "dims_report": "jobs",
    "FINAL_BLOCK": "lens",
    "fit_lens": "lens:fit",
    "jacobian_image": "views",
    "largest_columns": "views",
    "layer_table": "layers",
    "layerwise_report": "layer_report:layer_report",
    "Lens": "lens",
    "lens_counted": "lens.lens_fit:counted",
    "lens_markdown": "lens:markdown",
    "lens_reading": "lens",
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
    "SpectrumDecoder": "jobs",
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
