"""Analyses mapped over a store's prompts, results written back next to the Jacobians.

A result already in the store with the same parameters is reused, so a job interrupted
half-way continues where it stopped. The dask scheduler in use (a ``distributed.Client``
when one is active, else dask's default) runs the array work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from functools import lru_cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..aside import reason_of
from ..errors import InvalidArgumentError, OutputError
from ..numerals import parse_index
from ..outputs import write_output
from ..singular import decode_blocks
from ..tokens import piece
from .spectra import Spectrum, decode, dimensionality, singular_values, stored_svd

if TYPE_CHECKING:
    from ..store import AnalysisCache, StoredPrompt, StoreReader


def result_name(kind: str, token: int | None, target: str | None = None) -> str:
    """Where a result is kept in the store: ``svd_combined``, ``svd_token3``, ``spectrum_layer.2_token-1``, ..."""
    return f"{kind}{'' if target is None else f'_{target}'}_{'combined' if token is None else f'token{token}'}"


def _kept(cache: AnalysisCache, prompt_id: str, kind: str, token: int | None, target: str | None,
          n_tokens: int | None) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The result ``kind`` of the operator kept in ``cache``; with ``n_tokens``, token ``k`` kept as ``k - n`` (or
    ``k + n``: ``svd --token -1`` keeps ``svd_token-1``) is found too."""
    tokens = [token]
    if token is not None and n_tokens is not None:
        tokens.append(token - n_tokens if token >= 0 else token + n_tokens)
    return next((found for t in tokens if (found := cache.read(prompt_id, result_name(kind, t, target))) is not None),
                None)


def read_svd(cache: AnalysisCache, prompt_id: str, token: int | None, target: str | None = None, *,
             n_tokens: int | None = None) -> Spectrum | None:
    """The triplets :func:`prompt_svds` kept in ``cache`` for this operator (its parameters in ``params``), or None;
    with
    ``n_tokens``, also those kept under the token's index counted from the other end."""
    found = _kept(cache, prompt_id, "svd", token, target, n_tokens)
    if found is None:
        return None
    arrays, attrs = found
    params = attrs.get("params", {})
    return Spectrum(prompt_id, token, arrays["U"], arrays["S"], arrays["V"],
                    attrs.get("method", params.get("method", "?")), params, target)


def read_spectrum(cache: AnalysisCache, prompt_id: str, token: int | None, *,
                  n_tokens: int | None = None) -> np.ndarray | None:
    """Every singular value of the operator as :func:`dims` kept them in ``cache``, or None (``n_tokens``: as
    :func:`read_svd`)."""
    found = _kept(cache, prompt_id, "spectrum", token, None, n_tokens)
    return None if found is None else found[0]["S"]


def cached_spectrum(store: StoreReader, prompt: StoredPrompt, token: int | None) -> np.ndarray:
    """Every singular value of ``J_token`` (None: of ``[J_1 ... J_n]``), read from the store's analysis cache or
    computed and kept there."""
    s = read_spectrum(store.analyses, prompt.id, token)
    if s is None:
        s = singular_values(prompt, token)
        store.analyses.write(prompt.id, result_name("spectrum", token), {"S": s}, {"token": token})
    return s


class OpenedPrompts:
    """The prompts of one job, each opened (and its files checked) once, on first use, then kept for the job's other
    steps (the triplets, then their decoding and titles)."""

    def __init__(self, store: StoreReader) -> None:
        self.store = store
        self._opened: dict[str, StoredPrompt] = {}

    def __call__(self, prompt_id: str) -> StoredPrompt:
        if prompt_id not in self._opened:
            self._opened[prompt_id] = self.store.get(prompt_id)
        return self._opened[prompt_id]


def prompt_svds(store: StoreReader, prompt_ids: Iterable[str], k: int = 8, token: int | None = None, *,
        method: str = "randomized", power_iterations: int = 6, oversample: int = 10, seed: int = 0,
        target: str | None = None, progress: Any = None, opened: OpenedPrompts | None = None) -> list[Spectrum]:
    """Top-k triplets for each prompt (combined operator, or token ``token``; of the model output or of the
    layerwise ``target``), kept in the store's analysis cache. ``opened``: the job's prompts, opened once (a prompt
    whose triplets are kept is not opened)."""
    opened = OpenedPrompts(store) if opened is None else opened
    wanted = {"k": k, "method": method, "power_iterations": power_iterations, "oversample": oversample,
              "seed": seed}
    results = []
    for pid in prompt_ids:
        spec = read_svd(store.analyses, pid, token, target)
        if spec is None or spec.params != wanted:
            spec = stored_svd(opened(pid), k, token, method=method, power_iterations=power_iterations,
                              oversample=oversample, seed=seed, target=target)
            store.analyses.write(pid, result_name("svd", token, target), {"U": spec.U, "S": spec.S, "V": spec.V},
                                 {"params": wanted, "method": spec.method, "token": token, "target": target})
        results.append(spec)
        if progress is not None:
            progress.update()
    return results


@dataclass(frozen=True)
class DecodedIds:
    """A spectrum's singular vectors decoded to token ids (see :class:`SpectrumDecoder`), ``k`` triplets."""

    left_ids: np.ndarray  # (k, top) through the unembedding (a layerwise target's lens)
    left_scores: np.ndarray  # (k, top)
    right_ids: np.ndarray  # (k, top) through the embedding
    right_scores: np.ndarray  # (k, top)
    right_tokens: list[int]  # (k,) the input token each right vector was decoded at
    right_shares: list[float]  # (k,) that token's share of the right vector's energy

    def __getitem__(self, name: str) -> Any:
        """The field ``name``: key access for callers written against the former dict (view/)."""
        if name not in {f.name for f in fields(self)}:
            raise KeyError(name)
        return getattr(self, name)


class SpectrumDecoder:
    """Decodes the spectra of one store: left vectors through the unembedding, right ones through the embedding.

    The matrices are read from the store (checked against their SHA-256 there) and made float64 once, on first
    use, then kept: one decoder serves every prompt of a job. Left vectors of a residual-stream layerwise target
    live before the final norm and are decoded through ``W_U diag(g)``, those of ``*_normed`` and ``to_output``
    targets through ``W_U`` (see :func:`detjac.analysis.layers.lens`). For the combined operator each right vector
    is decoded at the token whose block carries most of its energy (reported with its share).
    """

    def __init__(self, store: StoreReader) -> None:
        self.store = store
        self._embedding: np.ndarray | None = None
        self._unembedding: dict[bool | None, np.ndarray] = {}  # None: the output's; else whether g is folded in

    def embedding(self) -> np.ndarray:
        """(vocab, col) float64."""
        if self._embedding is None:
            self._embedding = np.asarray(self.store.model_array("embedding"), dtype=np.float64)
        return self._embedding

    def unembedding(self, target: str | None) -> np.ndarray:
        """(vocab, row) float64: the matrix that decodes ``target``'s left vectors (None: the model output's)."""
        from ..targets import Target
        from .layers import lens

        key = None if target is None else Target.parse(target).after_final_norm
        if key not in self._unembedding:
            self._unembedding[key] = (np.asarray(self.store.model_array("unembedding"), dtype=np.float64)
                                      if target is None else lens(self.store, target)[0])
        return self._unembedding[key]

    def decode(self, spec: Spectrum, top: int = 8) -> DecodedIds:
        """The ``top`` tokens of each of ``spec``'s singular vectors."""
        left_ids, left_scores = decode(spec.U, self.unembedding(spec.target), top)
        k = spec.V.shape[-1]
        if spec.token is None:  # V (n_tokens, col, k): the columns of [J_1 ... J_n]'s right vectors, token by token
            V = np.asarray(spec.V, dtype=np.float64).reshape(-1, k)  # (n_tokens * col, k)
            right_ids, right_scores, where, shares = decode_blocks(V, spec.V.shape[0], self.embedding(), top)
        else:
            right_ids, right_scores = decode(spec.V, self.embedding(), top)
            where, shares = np.full(k, spec.token), np.ones(k)
        return DecodedIds(left_ids, left_scores, right_ids, right_scores, where.tolist(), shares.tolist())


def decode_spectrum(store: StoreReader, spec: Spectrum, top: int = 8) -> DecodedIds:
    """Decoded tokens of one spectrum's vectors (see :class:`SpectrumDecoder`; for many spectra of one store, make
    one decoder and call its :meth:`~SpectrumDecoder.decode`: it reads the matrices once)."""
    return SpectrumDecoder(store).decode(spec, top)


def stored_tokenizer(store: StoreReader) -> Any:
    """The ``tokenizers.Tokenizer`` kept in the store (checked against its SHA-256), or None without one."""
    data = store.model_bytes("tokenizer.json")
    return None if data is None else _parsed_tokenizer(data)


@lru_cache(maxsize=4)
def _parsed_tokenizer(data: bytes) -> Any:
    """``tokenizer.json``'s bytes parsed, once per content (the viewer asks for every page it computes: parsing
    SmolLM2's took about as long as the page)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(data.decode("utf-8"))


def piece_reader(store: StoreReader) -> Callable[[int], str]:
    """A function id -> the token's quoted text (:func:`detjac.tokens.piece`) by the tokenizer kept in the store,
    read once (the id as text without one)."""
    return partial(piece, stored_tokenizer(store))


def token_id(store: StoreReader, text: str) -> int:
    """The one token id of ``text`` by the store's tokenizer, or ``id:N`` for an id given directly."""
    vocab = store.model_array("embedding").shape[0]
    if text.startswith("id:"):
        tid = parse_index(text[3:], below=vocab)
        if tid is None:
            raise InvalidArgumentError(f"Expected id:N with 0 <= N < {vocab}. Got {text!r}.")
        return tid
    tok = stored_tokenizer(store)
    if tok is None:
        raise InvalidArgumentError(f"Expected a tokenizer in the store to look up {text!r}. Got none; "
                                   "give the token as id:N.")
    ids = tok.encode(text, add_special_tokens=False).ids
    if len(ids) != 1:
        raise InvalidArgumentError(f"Expected {text!r} to be one token. Got {len(ids)} tokens {ids}; pick one of "
                                   "them (a leading space often matters), or give id:N.")
    return int(ids[0])


def dims(store: StoreReader, prompt_ids: Iterable[str], progress: Any = None,
         opened: OpenedPrompts | None = None) -> list[dict[str, Any]]:
    """Dimensionality (stable rank, participation ratio, n90, n99) per prompt: combined and per token (``opened``:
    the job's prompts, opened once)."""
    opened = OpenedPrompts(store) if opened is None else opened
    rows = []
    for pid in prompt_ids:
        prompt = opened(pid)
        for token in [None, *range(prompt.n_tokens)]:
            s = cached_spectrum(store, prompt, token)
            d = dimensionality(s)
            rows.append({"prompt_id": pid, "token": "combined" if token is None else token,
                         "stable_rank": d.stable_rank, "participation_ratio": d.participation_ratio,
                         "n90": d.n90, "n99": d.n99, "sigma_1": float(s[0])})
        if progress is not None:
            progress.update()
    return rows


@dataclass(frozen=True)
class DimsReport:
    """:func:`dims`'s rows and the table written from them (None when not asked for)."""

    rows: list[dict[str, Any]]
    table: Path | None = None


def require_full(store: StoreReader, what: str) -> None:
    """InvalidArgumentError before any work when ``store`` is low-rank (``--keep rank:K``) and ``what`` needs every
    singular value: the message names the analyses that read its triplets and the run that gives the rest."""
    from ..store import Keep

    keep = Keep.of_run(store.run)
    if keep.low_rank:
        raise InvalidArgumentError(
            f"Expected a store with full Jacobians for {what}: it needs every singular value (stable rank, energy "
            f"ranks). Got {store.path}, a low-rank store (--keep {keep}: each prompt's top singular triplets only; "
            "`detjac analyze svd` and `decode` read them). Run the prompts again without --keep "
            "(`detjac run MODEL PROMPTS --out FULL.zarr`) for this.")


def dims_report(store: StoreReader, prompt_ids: Iterable[str], table: str | Path | None = None,
                progress: Any = None) -> DimsReport:
    """:func:`dims` of ``prompt_ids``, written to ``table`` when given (Parquet for a ``.parquet`` suffix, else
    CSV; see :func:`write_table`). ``progress`` (tqdm-like) is updated once per prompt."""
    require_full(store, "analyze dims")
    rows = dims(store, prompt_ids, progress=progress)
    return DimsReport(rows, write_table(rows, table) if table else None)


def write_table(rows: list[dict[str, Any]], path: Any) -> Path:
    """Rows of dicts as a table: Parquet for a ``.parquet`` path, else CSV (header from the first row).

    List values (e.g. decoded token ids) become Parquet lists, and space-separated text in CSV; a
    Parquet column whose values mix text and numbers (``token``: "combined" or an index) is text.
    Written beside ``path`` and renamed (:func:`detjac.outputs.write_output`): a full disk is an OutputError and
    leaves no file, never an empty or truncated one.
    """
    path = Path(path)
    if not rows:
        raise InvalidArgumentError(f"Expected rows to write to {path}. Got none.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            types = {key: {type(r[key]) for r in rows if r[key] is not None} for key in rows[0]}
            mixed = {key for key, kinds in types.items() if str in kinds and len(kinds) > 1}
            table = pa.Table.from_pylist([{k: str(v) if k in mixed else v for k, v in r.items()} for r in rows])
            return write_output(path, lambda handle: pq.write_table(table, handle))
        return write_output(path, _csv_text(rows))
    except OSError as exc:
        raise OutputError(f"Expected to write the table {path}. Got {reason_of(exc)}; nothing was written there."
                          ) from exc


def _csv_text(rows: list[dict[str, Any]]) -> str:
    import csv
    import io

    handle = io.StringIO(newline="")
    writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows({k: " ".join(map(str, v)) if isinstance(v, list | tuple) else v for k, v in r.items()}
                     for r in rows)
    return handle.getvalue()
