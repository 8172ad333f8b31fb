"""The detached Jacobian lens: a corpus-level operator per layer fitted from a store, decoded beside the logit lens
(:mod:`.jacobian_lens`), its resumable fit (:mod:`.lens_fit`), the running sums of a ``run --lens`` process
(:mod:`.lens_sums`) and its evaluation's summaries (:mod:`.lens_eval`). How it is defined: ``docs/lens.md``."""

from .jacobian_lens import (
    FINAL_BLOCK,
    FITTED,
    LENS_VERSION,
    Lens,
    check_lens_target,
    lens_reading,
    lens_readings,
    load_lens,
    relative_spread,
    save_lens,
    score_lens,
    token_rank,
)
from .lens_eval import lens_markdown, plot_agreement, plot_positions, summarize_lens, wilson
from .lens_fit import fit_lens, lens_counted
from .lens_sums import RunningSums

__all__ = ["FINAL_BLOCK", "FITTED", "LENS_VERSION", "Lens", "RunningSums", "check_lens_target", "fit_lens",
           "lens_counted", "lens_markdown", "lens_reading", "lens_readings", "load_lens", "plot_agreement",
           "plot_positions", "relative_spread", "save_lens", "score_lens", "summarize_lens", "token_rank", "wilson"]
