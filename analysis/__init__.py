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

# The façade's names, each once and under its own name: type checkers read them here, and so does lazy_exports, which
# imports each one's module on first use.
if TYPE_CHECKING:
    from .compare import compare_report
    from .decoded import decode_report
    from .graphs import GraphNeurons, recurring_neurons
    from .jobs import (
        DecodedIds,
        SpectrumDecoder,
        cached_spectrum,
        decode_spectrum,
        dims_report,
        piece_reader,
        prompt_svds,
        read_spectrum,
        read_svd,
        require_full,
        write_table,
    )
    from .layer_report import layerwise_report
    from .layers import layer_table, targets_heatmap
    from .lens import (
        FINAL_BLOCK,
        LENS_VERSION,
        Lens,
        RunningSums,
        check_lens_target,
        fit_lens,
        lens_counted,
        lens_markdown,
        lens_reading,
        lens_readings,
        load_lens,
        plot_agreement,
        plot_positions,
        relative_spread,
        save_lens,
        score_lens,
        summarize_lens,
        token_rank,
    )
    from .neuron_pages import check_neuron, clerp, neuron_page, relabel
    from .plots import SpectrumPanel, plot_spectra
    from .report import analysis_report
    from .spectra import Spectrum, dimensionality, low_rank_spectrum, singular_values, stored_svd
    from .supernodes import group_adjacency, group_completeness, group_neurons
    from .view_plots import plot_columns, plot_jacobian_image, plot_path
    from .views import jacobian_image, largest_columns, singular_path

__all__, __getattr__ = lazy_exports(__name__, __file__, renamed={"token_texts": "piece_reader"})
