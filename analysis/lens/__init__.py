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
    load_lens,
    readings,
    relative_spread,
    save_lens,
    score,
    token_rank,
)
from .lens_eval import markdown, plot_agreement, plot_positions, summarize, wilson
from .lens_fit import fit
from .lens_sums import RunningSums

__all__ = ["FINAL_BLOCK", "FITTED", "LENS_VERSION", "Lens", "RunningSums", "check_lens_target", "fit", "lens_reading",
           "load_lens", "markdown", "plot_agreement", "plot_positions", "readings", "relative_spread", "save_lens",
           "score", "summarize", "token_rank", "wilson"]
