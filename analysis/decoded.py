"""Singular vectors decoded to tokens (``detjac analyze svd|decode``): as records, a figure and a table.

:func:`decode_report` runs :func:`detjac.analysis.jobs.prompt_svds` (triplets kept in the store and
reused for the same parameters), decodes every triplet with
:func:`detjac.analysis.jobs.decode_spectrum` (left vectors through the unembedding, or for a
layerwise target through the final norm's gain and the unembedding; right vectors through
the input embedding) and writes the figure and the table asked for. The records carry the
decoded tokens as quoted text by the store's tokenizer, ready to print.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..targets import OUTPUT
from ..tokens import piece, token_labels
from . import jobs
from .plots import plot_decoded
from .spectra import Spectrum

if TYPE_CHECKING:
    from ..store import StoreReader


@dataclass(frozen=True)
class DecodedTriplet:
    """The ``index``-th (from 1) singular triplet: sigma and the tokens its vectors decode to.

    ``left`` and ``right`` are the decoded tokens as quoted text, space-separated; the right
    vector is decoded at token ``right_token``, whose block holds ``right_share`` of its energy
    (the token itself, share 1, for a per-token operator). ``left_texts`` / ``right_texts`` are
    the same tokens' texts unquoted, one per token (their ids as text without a tokenizer), and
    ``left_ids`` / ``right_ids`` their ids.
    """

    index: int
    sigma: float
    left: str
    right: str
    right_token: int
    right_share: float
    left_texts: tuple[str, ...] = ()
    right_texts: tuple[str, ...] = ()
    left_ids: tuple[int, ...] = ()
    right_ids: tuple[int, ...] = ()

    def cells(self) -> list[str]:
        """The row of the figure and the table: #, sigma, left tokens, ``[token] right tokens``."""
        return [f"{self.index}", f"{self.sigma:.4g}", self.left, f"[{self.right_token}] {self.right}"]


@dataclass(frozen=True)
class DecodedSpectrum:
    """One prompt's decoded triplets of one operator.

    ``title`` names the prompt (id, text, stored next token); ``target`` is ``"output"`` or the
    layerwise target; ``operator`` is ``[J_1 ... J_n]`` (combined) or ``J_<token>``.
    """

    prompt_id: str
    title: str
    target: str
    operator: str
    token: int | None
    triplets: list[DecodedTriplet]

    def section(self) -> tuple[str, list[list[str]]]:
        """(heading, rows) for :func:`detjac.analysis.plots.plot_decoded`."""
        return f"{self.title}: {self.target}, {self.operator}", [t.cells() for t in self.triplets]


@dataclass(frozen=True)
class DecodeReport:
    """The decoded spectra, one per prompt, and the files written (the figure, then the table)."""

    spectra: list[DecodedSpectrum]
    written: list[Path]


def decode_spectra(store: StoreReader, spectra: Sequence[Spectrum], top: int = 8,
                   opened: jobs.OpenedPrompts | None = None) -> list[DecodedSpectrum]:
    """Decode each spectrum's triplets to their ``top`` tokens (see :func:`detjac.analysis.jobs.decode_spectrum`);
    ``opened``: the job's prompts, opened once."""
    opened = jobs.OpenedPrompts(store) if opened is None else opened
    tokenizer = jobs.stored_tokenizer(store)  # read and checked once for the job
    text = partial(piece, tokenizer)
    decoder = jobs.SpectrumDecoder(store)  # the matrices read and checked once for every prompt

    def texts(token_ids: Sequence[int]) -> tuple[str, ...]:
        return tuple(token_labels(tokenizer, token_ids))

    decoded = []
    for spec in spectra:
        prompt = opened(spec.prompt_id)
        ids = decoder.decode(spec, top)
        triplets = []
        for i, sigma in enumerate(spec.S):
            left, right = [int(t) for t in ids.left_ids[i]], [int(t) for t in ids.right_ids[i]]
            triplets.append(DecodedTriplet(i + 1, float(sigma), " ".join(map(text, left)), " ".join(map(text, right)),
                                           int(ids.right_tokens[i]), float(ids.right_shares[i]),
                                           texts(left), texts(right), tuple(left), tuple(right)))
        decoded.append(DecodedSpectrum(
            spec.prompt_id, f"{spec.prompt_id} {prompt.prompt[:70]!r} -> next {prompt.attrs.get('next_token')!r}",
            spec.target or OUTPUT, "[J_1 ... J_n]" if spec.token is None else f"J_{spec.token}", spec.token,
            triplets))
    return decoded


def decoded_rows(spectra: Sequence[DecodedSpectrum]) -> list[dict[str, Any]]:
    """One table row per triplet, as data: prompt, target, token (``combined`` or the operator's index, as text),
    index, sigma, ``left_tokens`` / ``right_tokens`` (lists of token texts, unquoted), ``right_position`` (the token
    the right vector is decoded at), ``right_share`` (its block's share of the energy) and the lists of ids."""
    return [{"prompt_id": d.prompt_id, "target": d.target, "token": "combined" if d.token is None else str(d.token),
             "index": t.index, "sigma": t.sigma, "left_tokens": list(t.left_texts), "right_tokens": list(t.right_texts),
             "right_position": t.right_token, "right_share": t.right_share, "left_ids": list(t.left_ids),
             "right_ids": list(t.right_ids)}
            for d in spectra for t in d.triplets]


def csv_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` for a CSV file: each list as a JSON array (``[" Paris", " the"]``), readable and exact where
    tokens hold spaces, quotes or commas (``json.loads`` reads it back)."""
    return [{k: json.dumps(v, ensure_ascii=False) if isinstance(v, list) else v for k, v in r.items()} for r in rows]


def decode_report(store: StoreReader, prompt_ids: Sequence[str], *, k: int = 5, top: int = 8, token: int | None = None,
                  target: str | None = None, method: str = "randomized", power_iterations: int = 6,
                  plot: str | Path | None = None, table: str | Path | None = None,
                  progress: Any = None) -> DecodeReport:
    """Top-``k`` singular triplets of every prompt, decoded to ``top`` tokens each; optionally a figure and a table.

    Parameters
    ----------
    store : StoreReader
    prompt_ids : sequence of str
    k : int
        Singular triplets per prompt.
    top : int
        Decoded tokens per vector.
    token : int or None
        A token index (negative from the end) for its ``J_k``; None for the combined operator.
    target : str or None
        A stored layerwise target (``layer.2``, ``mlp_local.0``, ...); None for the model output.
    method : {"randomized", "gram", "exact"}
        How the triplets are computed (see :func:`detjac.analysis.spectra.stored_svd`).
    power_iterations : int
        Power iterations of the randomized method.
    plot : str or Path or None
        Write the decoded tokens as a figure here (PNG, SVG or PDF by suffix).
    table : str or Path or None
        Write one row per triplet here (:func:`decoded_rows`): Parquet for a ``.parquet`` suffix (token lists as
        list columns), else CSV (lists as JSON arrays).
    progress : tqdm-like or None
        Updated once per prompt.

    Returns
    -------
    DecodeReport

    Raises
    ------
    InvalidArgumentError
        For a target the store does not hold, or a token index out of range.
    """
    opened = jobs.OpenedPrompts(store)  # each prompt opened once, for its triplets and its title
    spectra = jobs.prompt_svds(store, prompt_ids, k, token, method=method, power_iterations=power_iterations,
                       target=target, progress=progress, opened=opened)
    decoded = decode_spectra(store, spectra, top, opened)
    written = []
    if plot:
        written.append(plot_decoded([d.section() for d in decoded], plot))
    if table:
        rows = decoded_rows(decoded)
        written.append(jobs.write_table(rows if Path(table).suffix == ".parquet" else csv_rows(rows), table))
    return DecodeReport(decoded, written)
