"""The layer report of a store (``detjac analyze layers``): tables, emergence and figures, written to a folder.

It composes :mod:`detjac.analysis.layers` (the layer table, emergence, heatmaps) with the
table writer and the figures of :mod:`detjac.analysis.plots`; the per-prompt results are kept
in the store by those functions and reused next time. Needs layerwise Jacobians in the store
(``detjac run ... --layers``); everything else is read from the store's public API.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError
from . import jobs, layers
from .plots import plot_emergence, plot_layer_dims, plot_token_heatmap

if TYPE_CHECKING:
    from ..store import StoreReader

TABLE_FORMATS = ("csv", "parquet")


@dataclass(frozen=True)
class LayerReport:
    """What :func:`layerwise_report` computed and wrote.

    ``rows`` are :func:`detjac.analysis.layers.layer_table`'s (one per prompt and target),
    ``emerged`` :func:`detjac.analysis.layers.emergence`'s (one per prompt and component);
    ``written`` the files in ``out``, tables first; ``token_text`` turns a token id into its
    quoted text by the store's tokenizer (the id as text without one).
    """

    rows: list[dict[str, Any]]
    emerged: list[dict[str, Any]]
    written: list[Path]
    out: Path
    top: int
    token_text: Callable[[int], str]
    targets: str = ""  # which targets were used, normed or not (:func:`detjac.analysis.layers.targets_used`)


def layerwise_report(store: StoreReader, prompt_ids: Sequence[str], out: str | Path, *, k: int = 4, top: int = 10,
                 token: str | None = None, component: str = "layer", heatmaps: int = 4,
                 table_format: str = "csv", progress: Any = None) -> LayerReport:
    """Layerwise decomposition of ``prompt_ids``: the layer table, emergence, and their tables and figures.

    Writes ``layers.<format>``, ``emergence.<format>``, ``layer_dims.png``, ``emergence.png``
    and ``heatmap_<prompt id>.png`` for the first ``heatmaps`` prompts (the tracked token's
    rank per layer and input token) to ``out``.

    Parameters
    ----------
    store : StoreReader
        A store with layerwise Jacobians.
    prompt_ids : sequence of str
        The prompts to analyze.
    out : str or Path
        Folder for the tables and figures (created).
    k : int
        Left singular vectors searched for the tracked token (``first_sv``).
    top : int
        A token "appears" when it is among this many decoded tokens.
    token : str or None
        The token to track: one token of the store's tokenizer, or ``id:N``; None tracks each
        prompt's prediction.
    component : str
        Targets of the heatmaps: a component of :data:`detjac.targets.COMPONENTS` (``layer``, ``layer_normed``, ...).
    heatmaps : int
        Heatmaps for this many prompts (the first ones).
    table_format : {"csv", "parquet"}
    progress : tqdm-like or None
        Updated once per prompt of the layer table.

    Returns
    -------
    LayerReport

    Raises
    ------
    InvalidArgumentError
        For an unknown ``table_format``, a ``token`` that is not one token, a store without
        layerwise Jacobians or without ``component`` targets.
    """
    if table_format not in TABLE_FORMATS:
        raise InvalidArgumentError(f"Expected table_format 'csv' or 'parquet'. Got {table_format!r}.")
    tracked = None if token is None else jobs.token_id(store, token)
    text = jobs.piece_reader(store)
    rows = layers.layer_table(store, prompt_ids, k=k, top=top, token=tracked, progress=progress)
    heats = [layers.token_heatmap(store, pid, component, token=tracked) for pid in list(prompt_ids)[:heatmaps]]
    emerged = layers.emergence(rows)
    folder = Path(out)
    written = [jobs.write_table(rows, folder / f"layers.{table_format}"),
               jobs.write_table(emerged, folder / f"emergence.{table_format}"),
               plot_layer_dims(rows, folder / "layer_dims.png"), plot_emergence(rows, folder / "emergence.png", top)]
    for pid, heat in zip(prompt_ids, heats, strict=False):
        written.append(plot_token_heatmap(heat, folder / f"heatmap_{pid}.png", text(heat["token"]),
                                          store.get(pid).prompt[:100]))
    return LayerReport(rows, emerged, written, folder, top, text, layers.targets_used(rows))
