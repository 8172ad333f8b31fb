"""The detached Jacobian lens: the fitted operator ``T̄_L`` per layer (:class:`Lens`), saved and loaded, and its
readings of a prompt's layer states beside the logit lens, scored against the model's own output.

What is averaged and the readings compared (``lens``, ``logit``, ``self``, ``exact``): ``docs/lens.md``.
Torch-free: the model's side is :mod:`detjac.runs.lens_apply`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from detjac.errors import InvalidArgumentError, StoreFormatError
from detjac.exactness import relative_error
from detjac.outputs import FOLDER, check_output
from detjac.safe_json import read_json

if TYPE_CHECKING:
    from detjac.store import StoreReader, StoreWriter

LENS_KEY = "detjac_lens"  # the attribute describing a lens (in lens/fitted and in a saved lens)
LENS_VERSION = 1
FITTED = "fitted"  # lens/fitted: the lens of a store
FINAL_BLOCK = "final_block"  # info["target"] of a lens onto the last layer's output before the final norm
DIMS = {"mean": ("layer", "row", "col"), "second_moment": ("layer", "row", "col"), "count": ("layer",),
        "layer": ("layer",)}
IDENTITY = ("model_id", "model_path", "model_type", "config_sha256", "revision", "weights_sha256", "dtype", "detach",
            "convention", "quantize", "position")


@dataclass(frozen=True)
class Lens:
    """A fitted lens: ``mean[i]`` is ``T̄`` of layer ``layers[i]`` (d, d), ``second_moment[i]`` the element-wise
    ``E[T_p ⊙ T_p]``, ``count[i]`` the prompts averaged; ``info`` its description (model, kind, prompts)."""

    layers: np.ndarray  # (layer,) int64
    mean: np.ndarray  # (layer, row, col) float64
    second_moment: np.ndarray  # (layer, row, col)
    count: np.ndarray  # (layer,)
    info: dict[str, Any]

    @property
    def kind(self) -> str:
        """``detached`` or ``ordinary``: which Jacobians were averaged."""
        return str(self.info.get("kind"))

    @property
    def before_norm(self) -> bool:
        """Whether the lens maps onto the last layer's output before the final norm (the reference ``jlens``
        and its artifacts: a reading is ``norm(T̄ h)``), rather than onto the final normed state ``y``."""
        return self.info.get("target") == FINAL_BLOCK

    def operator(self, layer: int) -> np.ndarray:
        """``T̄`` of ``layer`` (d, d); InvalidArgumentError for a layer the lens was not fitted at."""
        where = np.flatnonzero(self.layers == layer)
        if not len(where):
            raise InvalidArgumentError(f"Expected a layer the lens was fitted at ({', '.join(map(str, self.layers))})."
                                       f" Got {layer}.")
        return self.mean[int(where[0])]

    def apply(self, layer: int, states: np.ndarray) -> np.ndarray:
        """``T̄_L h`` for states (..., d): the lens's reading of the output, (..., d)."""
        return states @ self.operator(layer).T


def relative_spread(lens: Lens) -> np.ndarray:
    """Per layer, ``Σ Var(T_p) / ‖T̄‖_F²`` with ``Var = E[T⊙T] − T̄²`` element-wise: 0 when every prompt's
    same-position operator equals the lens (population variance; clipped at 0 against rounding)."""
    var = np.clip(lens.second_moment - lens.mean**2, 0.0, None)
    return var.sum(axis=(1, 2)) / (lens.mean**2).sum(axis=(1, 2))


def lens_attrs(store: StoreReader, ids: list[str]) -> dict[str, Any]:
    """The description kept with a lens fitted from ``store`` on the prompts ``ids``."""
    from detjac import __version__

    run = store.run
    return {LENS_KEY: {
        "version": LENS_VERSION, "kind": "detached" if run.get("detach", True) else "ordinary",
        "target": "to_output", "operator": "mean over prompts of dy_p/dh_{L,p}, p the target position",
        "model": {key: run.get(key) for key in IDENTITY}, "n_layers": run.get("n_layers"),  # the lens carries its model
        "source": str(store.path), "n_prompts": len(ids),
        "prompts_sha256": hashlib.sha256(json.dumps(sorted(ids)).encode()).hexdigest(),
        "detjac_version": __version__}}


def _arrays(layers: np.ndarray, mean: np.ndarray, second: np.ndarray, count: np.ndarray) -> dict[str, np.ndarray]:
    return {"layer": layers.astype(np.int64), "mean": mean, "second_moment": second, "count": count.astype(np.int64)}


def write_fitted(store: StoreWriter, layers: np.ndarray, mean: np.ndarray, second: np.ndarray, count: np.ndarray,
                 attrs: dict[str, Any]) -> None:
    """Write ``lens/fitted`` (sealed, named dimensions)."""
    store.write_lens(FITTED, _arrays(layers, mean, second, count), attrs, DIMS)


def _as_lens(arrays: dict[str, np.ndarray], attrs: dict[str, Any], where: str) -> Lens:
    info = attrs.get(LENS_KEY)
    if not isinstance(info, dict) or set(DIMS) - set(arrays):
        raise StoreFormatError(f"Expected a detjac lens (attribute {LENS_KEY!r}, arrays {', '.join(DIMS)}) at "
                               f"{where}. Got attributes {sorted(attrs)} and arrays {sorted(arrays)}.")
    if info.get("version") != LENS_VERSION:
        raise StoreFormatError(f"Expected lens version {LENS_VERSION} at {where}. Got {info.get('version')!r}.")
    return Lens(arrays["layer"], arrays["mean"], arrays["second_moment"], arrays["count"], info)


def load_lens(path: str | Path) -> Lens:
    """A lens from a store fitted with ``detjac lens fit`` (its ``lens/fitted``) or from a saved lens folder.

    Raises StoreFormatError for anything else, CorruptError for a lens changed since it was written.
    """
    from detjac.store import read_sealed

    path = Path(path)
    if (path / "zarr.json").is_file() and "detjac_store" in _attributes(path):
        from detjac.store import open_store

        found = open_store(path).read_lens(FITTED)
        if found is None:
            raise InvalidArgumentError(f"Expected a fitted lens in the store {path}. Got none: run "
                                       f"`detjac lens fit {path}` first.")
        return _as_lens(*found, f"{path}/lens/{FITTED}")
    found = read_sealed(path, f"the lens {path}", hint="Save it again (`detjac lens save`).")
    if found is None:
        raise StoreFormatError(f"Expected a detjac lens (a zarr folder written by `detjac lens save`) or a store "
                               f"with a fitted lens at {path}. Got no zarr.json there.")
    return _as_lens(*found, str(path))


def _attributes(path: Path) -> dict[str, Any]:
    """The attributes in ``path/zarr.json`` (StoreFormatError where they cannot be read)."""
    try:
        attrs = read_json(path / "zarr.json").get("attributes", {})
    except (OSError, ValueError, AttributeError) as exc:
        raise StoreFormatError(f"Expected a readable zarr.json in {path}. Got {exc}.") from None
    return attrs if isinstance(attrs, dict) else {}


def save_lens(lens: Lens, out: str | Path, force: bool = False) -> Path:
    """Write ``lens`` by itself to the folder ``out`` (a sealed zarr group; replaced only with ``force``)."""
    from detjac.store import write_sealed

    out = check_lens_target(out, force)
    return write_sealed(out.parent, out.name, _arrays(lens.layers, lens.mean, lens.second_moment, lens.count),
                        {LENS_KEY: lens.info}, f"save the lens to {out}", DIMS)


def check_lens_target(out: str | Path, force: bool = False,
                      reads: Iterable[tuple[str, str | Path]] = ()) -> Path:
    """``out`` if a lens may be saved there: a new folder, or with ``force`` a saved lens (never a store, a link, a
    file or a folder of other files), and what :func:`detjac.outputs.check_output` accepts (an existing parent
    folder, outside ``reads`` and outside any store or index); InvalidArgumentError otherwise. Call it before the
    work a lens costs."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not force:
            raise InvalidArgumentError(f"Expected a new folder for the lens. Got {out}, which exists (--force "
                                       "replaces it if it is a saved lens).")
        found = _saved_lens_at(out)
        if found is not None:
            raise InvalidArgumentError(f"Expected a saved lens at {out} to replace (--force replaces only a lens "
                                       f"written by `detjac lens save`). Got {found}; nothing was written.")
    return check_output(out, force=force, kind=FOLDER, reads=reads)


def _saved_lens_at(path: Path) -> str | None:
    """None when ``path`` is a folder holding a saved lens and nothing else, else what it is (so that it is not
    deleted): a link, a file, a detjac store, a folder of other files."""
    if path.is_symlink():
        return "a symbolic link"
    if not path.is_dir():
        return "a file"
    try:
        attrs = read_json(path / "zarr.json").get("attributes", {})
    except (OSError, ValueError, AttributeError):
        attrs = None
    if isinstance(attrs, dict) and "detjac_store" in attrs:
        return "a detjac store"
    if not isinstance(attrs, dict) or LENS_KEY not in attrs:
        return f"a folder that is not a saved lens ({sum(1 for _ in path.iterdir())} entries)"
    names = {p.name for p in path.iterdir()}
    if not names <= {"zarr.json", *DIMS}:
        return f"a saved lens with other files beside it ({', '.join(sorted(names - {'zarr.json', *DIMS}))})"
    return None


def token_rank(logits: np.ndarray, token: int) -> int:
    """1-based rank of ``token`` among ``logits`` (vocab,), highest first; ties count in its favour."""
    return int((logits > logits[token]).sum()) + 1


def lens_reading(lens: Lens, layer: int, states: np.ndarray, norm: Callable[[np.ndarray], np.ndarray]
                 ) -> np.ndarray:
    """What ``lens`` reads as the final normed state from layer ``layer``'s states (..., d): ``T̄ h``, passed
    through the model's final norm ``norm`` (each vector's scale from itself) when the lens maps onto the final
    block's output before the norm (:attr:`Lens.before_norm`)."""
    read = lens.apply(layer, states)
    return norm(read) if lens.before_norm else read


def lens_readings(lenses: dict[str, Lens], layer: int, states: np.ndarray, normed: np.ndarray, position: int,
             exact: np.ndarray | None, norm: Callable[[np.ndarray], np.ndarray] | None = None
             ) -> dict[str, np.ndarray]:
    """What each method reads as the output at ``position`` from layer ``layer``'s states (n, d): every lens of
    ``lenses`` by its name, ``logit``, and (with ``exact``, the prompt's own (d, n, d) ``to_output`` Jacobian)
    ``self`` and ``exact``; see the module docstring. ``normed`` (d,) is the final norm of ``states[position]``;
    ``norm`` the model's final norm, needed for a lens that maps before it (:func:`lens_reading`)."""
    h = states[position]
    if norm is None and any(lens.before_norm for lens in lenses.values()):
        raise InvalidArgumentError("Expected the model's final norm to read a lens that maps onto the final block's "
                                   "output before it. Got none.")
    out = {name: lens_reading(lens, layer, h, norm) for name, lens in lenses.items()}  # type: ignore[arg-type]
    out["logit"] = normed
    if exact is not None:
        out["self"] = exact[:, position, :] @ h
        out["exact"] = np.einsum("rtc,tc->r", exact, states)
    return out


def score_lens(readings_: dict[str, np.ndarray], unembedding: Any, output: np.ndarray
               ) -> dict[str, dict[str, Any]]:
    """Per method: ``rank`` of the model's prediction ``argmax W_U y`` in ``W_U ŷ``, ``error`` ``‖ŷ−y‖/‖y‖``,
    ``top`` the 5 top decoded token ids (ties in vocabulary order). ``unembedding`` (vocab, d): a numpy array or
    rows read on demand (:func:`detjac.singular.decode_top`): the vocabulary is crossed a chunk at a time."""
    from detjac.singular import decode_top, rank_of

    predicted = int(decode_top(np.asarray(output)[:, None], unembedding, 1)[0][0, 0])
    methods = list(readings_)
    if not methods:
        return {}
    Y = np.stack([np.asarray(readings_[m]) for m in methods], axis=1)  # (d, methods)
    ranks = rank_of(Y, unembedding, [predicted] * len(methods))
    tops = decode_top(Y, unembedding, 5)[0]
    return {method: {"rank": int(ranks[j]), "error": relative_error(readings_[method], output),
                     "top": tops[j].tolist(), "predicted": predicted} for j, method in enumerate(methods)}
