"""The zarr backend, reading one prompt: the group ``prompts/<id>`` opened read-only, its attributes checked, its
chunks read strictly (:mod:`.strict`), and :func:`verify_prompt` (``docs/store-format.md``, "What verify proves").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from detjac.errors import InvalidArgumentError, StoreError
from detjac.exactness import DTYPE_BOUND, relative_error
from detjac.targets import Target

from .. import format as fmt
from ..graph_tables import check_tables, graph_json
from ..integrity import CorruptError, check_attrs_seal, check_hashes, check_name, check_seal, damage_reason, read_attrs
from ..reader import VerifyResult
from ..schema import attrs_problem
from ..stored_prompt import StoredPrompt
from .claimed import check_claimed, prompt_bounds


@dataclass(frozen=True)
class StoreContext:
    """What a prompt needs to know of its store: where it is, its format version and its run."""

    path: Path
    format_version: int
    run: dict[str, Any]

    @property
    def sealed(self) -> bool:
        return self.format_version >= fmt.SEALED_SINCE


def checked_attrs(path: Path, store: StoreContext, files: bool = True) -> dict[str, Any]:
    """The attributes of the prompt group at ``path``: their types checked, and in format 2 their SHA-256 and (with
    ``files``) the names and sizes of the prompt's files (raises CorruptError naming the prompt)."""
    try:
        attrs = read_attrs(path)
        problem = attrs_problem(attrs)
        if problem is not None:
            raise CorruptError(problem)
        if store.sealed and files:
            check_seal(path, attrs, hashes=False)
        elif store.sealed:
            check_attrs_seal(path, attrs)
    except CorruptError as exc:
        raise CorruptError(f"Expected an intact prompt {path.name} in {store.path}. Got a damaged one: {exc}. "
                           "`detjac store verify` checks every prompt.") from exc
    return attrs


class ZarrPrompt(StoredPrompt):
    """A complete prompt group, opened read-only.

    Raises
    ------
    CorruptError
        The prompt's attributes are malformed or (format 2) changed since commit, or a file it
        was committed with is missing, resized or joined by another; the message says which.
    """

    def __init__(self, path: Path, store: StoreContext) -> None:
        from .strict import open_group, sparse_layerwise

        self.path, self.id, self.store = path, path.name, store
        self.attrs = checked_attrs(path, store)
        what = f"prompt {self.id} in {store.path}"
        n_tokens = self.attrs.get("n_tokens")
        if type(n_tokens) is int:  # shapes the metadata claims, against the prompt and the model, before any read
            check_claimed(path, what, *prompt_bounds(path, n_tokens), whole=False)
        self._group = open_group(path, what, None if store.sealed else sparse_layerwise)

    def _full(self) -> Any:
        if self.without_jacobian:
            raise StoreError(f"Prompt {self.id} keeps no Jacobian (--keep none: a `detjac run --lens` prompt, whose "
                             "Jacobians went into the store's lens sums). Its token ids, embeddings and output are "
                             "stored; re-run it with `detjac run` (another --out) for its Jacobian.")
        if self.low_rank:
            raise StoreError(f"Prompt {self.id} was stored in low-rank mode ({self.attrs.get('keep')}): it has no "
                             "full Jacobian. Use prompt.triplets(k) for token k or prompt.triplets() for all tokens.")
        return self._group["jacobian"]

    def _token(self, k: int) -> int:
        n = self.n_tokens
        if not -n <= k < n:
            raise InvalidArgumentError(f"Expected a token index in [-{n}, {n}) for prompt {self.id}. Got {k}.")
        return k % n

    def triplets(self, k: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.low_rank:
            self._full()  # a prompt without any Jacobian says so
            raise StoreError(f"Prompt {self.id} holds the full Jacobian, not triplets; use jacobian() or operator().")
        if k is None:
            return tuple(self._group[f"combined_{x}"][...] for x in "USV")  # type: ignore[return-value]
        k = self._token(k)
        return tuple(self._group[f"token_{x}"][k] for x in "USV")  # type: ignore[return-value]

    def jacobian(self, lazy: bool = True) -> Any:
        arr = self._full()
        if lazy:
            import dask.array as da

            return da.from_zarr(arr)
        return arr[...]

    def operator(self, k: int) -> np.ndarray:
        return self._full()[:, self._token(k), :]

    @property
    def layerwise_targets(self) -> list[str]:
        if fmt.LAYERWISE not in self._group:
            return []
        return sorted(self._group[fmt.LAYERWISE].group_keys(), key=Target.parse)

    def layerwise(self, target: str, array: str = "jacobian", lazy: bool = True) -> Any:
        if target not in self.layerwise_targets:
            raise InvalidArgumentError(f"Expected a layerwise target of prompt {self.id} "
                                       f"({', '.join(self.layerwise_targets) or 'none stored'}). Got {target!r}.")
        group = self._group[f"{fmt.LAYERWISE}/{check_name(target, 'a layerwise target')}"]
        if array not in group.array_keys():
            raise InvalidArgumentError(f"Expected one of {', '.join(sorted(group.array_keys()))} for {target}. "
                                       f"Got {array!r}.")
        if array == "jacobian" and lazy:
            import dask.array as da

            return da.from_zarr(group[array])
        return group[array][...]

    def layerwise_info(self, target: str) -> dict[str, Any]:
        self.layerwise(target, "output")
        return {**dict(self._group[f"{fmt.LAYERWISE}/{target}"].attrs),
                **self.attrs.get("layerwise", {}).get(target, {})}

    def to_xarray(self) -> Any:
        """The prompt's arrays as a lazy ``xarray.Dataset`` (dask-backed; needs xarray): dimensions ``row``,
        ``token``, ``col``, and the token coordinates ``token`` (position), ``token_ids``, ``token_text``.
        The same as ``xarray.open_zarr(prompt.path)``."""
        import xarray as xr

        return xr.open_zarr(self.path, consolidated="consolidated_metadata" in self._metadata())

    def _metadata(self) -> dict[str, Any]:
        from detjac.safe_json import read_json

        return read_json(self.path / "zarr.json")

    def graph(self) -> dict[str, Any] | None:
        read = self._graph_group()
        return None if read is None else self._checked(lambda: graph_json(*read))

    def graph_arrays(self) -> dict[str, np.ndarray] | None:
        read = self._graph_group()
        if read is None:
            return None
        self._checked(lambda: check_tables(read[0]))
        return read[0]

    def _graph_group(self) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """The graph group's arrays (every chunk decoded and checked) and attributes; None without a graph."""
        if fmt.GRAPH not in self._group.group_keys():
            return None
        check_claimed(self.path / fmt.GRAPH, f"the graph of prompt {self.id} in {self.store.path}",
                      at_most=prompt_bounds(self.path, self.n_tokens)[1])  # read whole: it must fit
        if self.store.sealed:  # every chunk's SHA-256 before any is decoded: an equal-sized swap never reads back
            try:
                check_hashes(self.path, self.attrs, f"{fmt.GRAPH}/")
            except CorruptError as exc:
                raise CorruptError(f"Expected an intact graph of prompt {self.id} in {self.store.path}. Got a damaged "
                                   f"one: {exc}. `detjac store verify` checks every prompt.") from exc
        group = self._group[fmt.GRAPH]

        def read() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
            try:
                return {name: group[name][...] for name in group.array_keys()}, dict(group.attrs)
            except ValueError as exc:  # a chunk of another length than its array's metadata says (resealed)
                raise StoreError(f"a chunk that does not decode to its array's shape ({exc})") from exc

        return self._checked(read)

    def _checked(self, read: Any) -> Any:
        """``read()``, a damaged graph's StoreError raised as a CorruptError naming the prompt."""
        try:
            return read()
        except StoreError as exc:
            if isinstance(exc, CorruptError):
                raise
            raise CorruptError(f"Expected an intact graph of prompt {self.id} in {self.store.path}. Got a damaged "
                               f"one: {exc}") from exc

    def array(self, name: str) -> np.ndarray:
        names = sorted(set(self._group.array_keys()) - {"jacobian", *fmt.COORDINATES})
        if name not in names:
            raise InvalidArgumentError(f"Expected one of {', '.join(names)}. Got {name!r}.")
        return self._group[name][...]


def verify_prompt(path: Path, store: StoreContext | None = None) -> VerifyResult:
    """Check one prompt on its own: seal and every file's SHA-256 (format 2), every chunk decoded (crc32c), the
    arrays against the attributes, and each Jacobian's reconstruction within the bound of the run's dtype.

    Parameters
    ----------
    path : Path
        The prompt's folder, ``<store>/prompts/<id>``.
    store : StoreContext or None
        Its store; read from ``path``'s grandparent when None.

    Returns
    -------
    VerifyResult
        ``ok``, or the reason the prompt is corrupt; never raises for a damaged prompt.
    """
    pid = path.name
    if path.is_symlink():  # its files are outside the store: never hashed, never counted as ok
        return VerifyResult(pid, False, None, f"a symlink to {path.resolve()}: detjac reads only inside the store")
    try:
        if store is None:
            root_path = path.parent.parent
            root = fmt.read_root(root_path)
            store = StoreContext(root_path, root["format_version"], root.get("run", {}))
        prompt = ZarrPrompt(path, store)
        if store.sealed:
            check_seal(path, prompt.attrs, hashes=True)
        return _check_numbers(prompt, store)
    except Exception as exc:  # noqa: BLE001 - any failure to read or check it means the prompt is corrupt
        return VerifyResult(pid, False, None, damage_reason(exc) if isinstance(exc, CorruptError) else
                            f"unreadable: {type(exc).__name__}: {exc}")


def _check_numbers(prompt: ZarrPrompt, store: StoreContext) -> VerifyResult:
    """The prompt's arrays decoded and checked against its attributes and against each other."""
    _check_tokens(prompt)
    prompt.graph()  # every graph chunk decoded (crc32c) and the tables checked to form a graph
    if prompt.low_rank:
        return _verify_low_rank(prompt)
    if prompt.without_jacobian:  # nothing to reconstruct: the arrays decode (checksums) and have their shapes
        if "jacobian" in prompt._group.array_keys() or prompt.array("output").ndim != 1:
            raise CorruptError("a --keep none prompt holds a jacobian array, or an output that is not a vector")
        return VerifyResult(prompt.id, True, None)
    bound = DTYPE_BOUND.get(store.run.get("dtype"), DTYPE_BOUND["float64"])
    detached = store.run.get("detach", True) is not False
    x = prompt.array("embeddings").astype(np.float64)
    y = prompt.array("output").astype(np.float64)
    recon = _reconstruct(prompt._group["jacobian"], x, y.shape)
    if "bias" in prompt._group.array_keys():  # an affine model: y = sum_k J_k x_k + b
        recon += prompt.array("bias").astype(np.float64)
    error = relative_error(recon, y)
    for target in prompt.layerwise_targets:  # each reconstructs its own output, within the same bound
        t_error = _layerwise_error(prompt, target, x)
        if detached and not t_error <= bound:
            return VerifyResult(prompt.id, False, error, f"layerwise {target}: reconstruction error {t_error:.3e} "
                                                         f"above {bound:.1e} (the bound of {store.run.get('dtype')})")
    stored = prompt.attrs.get("reconstruction_error")
    if not detached:  # an ordinary Jacobian: it must reproduce its stored error
        if stored is None or not abs(error - stored) <= bound * max(1.0, stored):
            return VerifyResult(prompt.id, False, error, f"reconstruction error {error:.3e} differs from the stored "
                                                         f"{stored!r}")
        return VerifyResult(prompt.id, True, error)
    if not error <= bound:
        return VerifyResult(prompt.id, False, error, f"reconstruction error {error:.3e} above {bound:.1e} (the "
                                                     f"bound of {store.run.get('dtype')})")
    return VerifyResult(prompt.id, True, error)


def _check_tokens(prompt: ZarrPrompt) -> None:
    """``token_ids`` decodes and equals the ids in the attributes; the arrays have ``n_tokens`` tokens."""
    ids = prompt.array("token_ids")
    n = prompt.n_tokens
    if ids.shape != (n,):
        raise CorruptError(f"token_ids has shape {ids.shape}, the prompt has {n} tokens")
    if "token_ids" in prompt.attrs and ids.tolist() != prompt.attrs["token_ids"]:
        raise CorruptError("the token_ids array differs from the token ids in the attributes")
    embeddings = prompt._group["embeddings"]
    if embeddings.shape[0] != n:
        raise CorruptError(f"embeddings has {embeddings.shape[0]} tokens, the prompt has {n}")


def _reconstruct(arr: Any, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``sum_k J_k x_k`` of a stored (row, token, col) Jacobian, chunk by chunk, in float64."""
    if arr.shape[0] != shape[0] or arr.shape[1:] != x.shape:
        raise CorruptError(f"a Jacobian of shape {arr.shape} does not map inputs {x.shape} to outputs {shape}")
    recon = np.zeros(shape, dtype=np.float64)
    rows, tokens = arr.chunks[0], arr.chunks[1]
    for r in range(0, arr.shape[0], rows):
        for k in range(0, arr.shape[1], tokens):
            block = arr[r:r + rows, k:k + tokens].astype(np.float64)
            recon[r:r + rows] += np.einsum("rtc,tc->r", block, x[k:k + tokens])
    return recon


def _layerwise_error(prompt: ZarrPrompt, target: str, embeddings: np.ndarray) -> float:
    """``|| sum_k J_k x_k - output || / || output ||`` of one layerwise target, chunk by chunk."""
    group = prompt._group[f"{fmt.LAYERWISE}/{target}"]
    source = Target.parse(target).source_array  # inputs (*_local), input (to_output) or None: the embeddings
    x = prompt.layerwise(target, source).astype(np.float64) if source is not None else embeddings
    y = prompt.layerwise(target, "output").astype(np.float64)
    return relative_error(_reconstruct(group["jacobian"], x, y.shape), y)


def _verify_low_rank(prompt: ZarrPrompt) -> VerifyResult:
    """Decode every array (checksums); singular values finite, non-negative, descending, not above the energy."""
    arrays = {name: prompt._group[name][...] for name in prompt._group.array_keys()}
    n, rank = prompt.n_tokens, prompt.attrs.get("rank")
    for name in ("token_U", "token_S", "token_V", "token_frobenius_sq", "combined_U", "combined_S", "combined_V"):
        if name not in arrays:
            raise CorruptError(f"the low-rank array {name} is missing")
    if arrays["token_S"].shape[0] != n or (rank is not None and arrays["combined_S"].shape != (rank,)):
        raise CorruptError(f"token_S {arrays['token_S'].shape} / combined_S {arrays['combined_S'].shape} do not "
                           f"match {n} tokens and rank {rank}")
    for name in ("token_S", "combined_S"):
        s = arrays[name].astype(np.float64)
        if not np.all(np.isfinite(s)) or np.any(s < 0) or np.any(np.diff(s, axis=-1) > 1e-12 * s.max(initial=1)):
            return VerifyResult(prompt.id, False, None, f"{name} is not a valid descending spectrum")
    energy = (arrays["token_S"].astype(np.float64) ** 2).sum(-1)
    if np.any(energy > arrays["token_frobenius_sq"] * (1 + 1e-6) + 1e-300):
        return VerifyResult(prompt.id, False, None, "singular values exceed the stored Frobenius norms")
    return VerifyResult(prompt.id, True, None)
