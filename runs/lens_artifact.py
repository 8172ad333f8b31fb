"""Lenses that travel: the Jacobian-lens artifact format of the reference implementation (Anthropic's
``jacobian-lens``, read and written by TransformerLens 4.3.0 ``JacobianLens``), both ways.

An artifact is one file written with ``torch.save`` and read with ``torch.load(weights_only=True)``::

    {"J": {layer: (d_model, d_model) tensor}, "n_prompts": int, "source_layers": [int], "d_model": int,
     "metadata": {...}}

``J[layer]`` maps the output of block ``layer`` (rows: the final block's output, before the final norm; columns: the
layer's output, so a reading is ``norm(J h)``), float16 by default. A fit checkpoint of the reference holds
``jacobian_sum`` (the sums over prompts) and ``n_done`` instead: its lens is ``sum / n_done``.

:func:`export_lens` writes any detjac lens so; :func:`read_lens` reads a saved lens folder, a store, an artifact, a
checkpoint, or ``org/name:path/in/repo.pt`` from the local Hugging Face cache (never the network) into one
:class:`~detjac.analysis.Lens`, checked (keys, shapes, finite values) before anything uses it. Only
``torch.load(weights_only=True)`` ever reads a file: a pickled object is refused. Whether the lens fits a model
(``d_model``, layers) is checked where the model is loaded (:func:`detjac.runs.lens_apply.check_lens_model`).

Guarantees and limits: a lens fitted onto the final normed state ``y`` (detjac's same-position lens, and ``jlens``
lenses saved before the reference's conventions were adopted) is exported as ``diag(1/g) T̄`` with ``g`` the final
norm's gain, so ``norm(J h)`` is a positive multiple of detjac's reading ``T̄ h`` up to the norm's ``eps`` (the same
top tokens); that holds for an RMSNorm without centring, not for a LayerNorm that subtracts the mean.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from detjac.errors import InvalidArgumentError, StoreFormatError
from detjac.numerals import parse_index
from detjac.outputs import check_output, write_output
from detjac.revisions import cached_commit, check_inside

if TYPE_CHECKING:
    from detjac.analysis import Lens

DTYPES = ("float16", "float32")
DETJAC_KEY = "detjac"  # metadata["detjac"]: detjac's provenance, beside whatever keys the reference uses
ARTIFACT_VERSION = 1


def _plain(value: Any) -> Any:
    """``value`` as None, bool, int, float, str, lists and string-keyed dicts only (what ``weights_only`` reloads)."""
    return json.loads(json.dumps(value, default=str))


def artifact_payload(lens: Lens, *, dtype: str = "float16", gain: np.ndarray | None = None,
                     n_layers: int | None = None) -> dict[str, Any]:
    """The artifact of ``lens`` (see the module docstring), tensors in ``dtype``.

    Parameters
    ----------
    lens : Lens
        Any detjac lens.
    dtype : str
        ``float16`` (the reference's default) or ``float32``.
    gain : ndarray or None
        (d,) the final norm's gain: needed for a lens onto the final normed state (rows are divided by it).
    n_layers : int or None
        The model's layer count: the last layer is left out (the reference never fits it: its transport is the
        identity, and TransformerLens' readout refuses a matrix there). Default: the lens's record of it.

    Raises
    ------
    InvalidArgumentError
        An unknown dtype, a gain missing or with zeros, no layer left.
    """
    import torch

    from detjac import __version__

    if dtype not in DTYPES:
        raise InvalidArgumentError(f"Expected a dtype among {', '.join(DTYPES)}. Got {dtype!r}.")
    d = int(lens.mean.shape[-1])
    rows = None
    if not lens.before_norm:
        if gain is None:
            raise InvalidArgumentError(
                f"Expected the model's final norm gain to export a lens onto the final normed state (target "
                f"{lens.info.get('target')!r}: the artifact's matrices map onto the state before the norm). Got "
                "none: give the model (--model).")
        g = np.asarray(gain, dtype=np.float64).reshape(-1)
        if g.shape != (d,) or not np.all(np.isfinite(g)) or np.any(g == 0):
            raise InvalidArgumentError(f"Expected a final norm gain of {d} finite non-zero values. Got shape "
                                       f"{g.shape} with {int(np.sum(~np.isfinite(g) | (g == 0)))} zero or "
                                       "non-finite values.")
        rows = 1.0 / g
    n_layers = n_layers if n_layers is not None else lens.info.get("n_layers")
    layers = artifact_layers(lens, n_layers)
    J = {}
    for layer in layers:
        m = lens.operator(layer)
        J[layer] = torch.from_numpy(np.ascontiguousarray(m if rows is None else rows[:, None] * m)).to(
            getattr(torch, dtype))
    info = lens.info
    provenance = {
        "format_version": ARTIFACT_VERSION, "detjac_version": __version__,
        "estimator": info.get("estimator", "same-position"), "kind": lens.kind, "target": info.get("target"),
        "converted": None if rows is None else "rows divided by the final norm's gain (detjac's lens maps onto "
                                               "the final normed state)",
        "operator": info.get("operator"), "model": info.get("model"), "n_prompts": info.get("n_prompts"),
        "count": [int(c) for c in lens.count], "prompts_sha256": info.get("prompts_sha256"),
        "skipped_prompts": info.get("skipped_prompts"), "skip_first_positions": info.get("skip_first_positions"),
        "max_seq_len": info.get("max_seq_len"), "bos": info.get("bos"), "n_layers": n_layers,
        "source": info.get("source"),
        "left_out_layers": [int(x) for x in lens.layers if int(x) not in layers]}
    return {"J": J, "n_prompts": int(min(lens.count)), "source_layers": layers, "d_model": d,
            "metadata": {DETJAC_KEY: _plain(provenance)}}


def artifact_layers(lens: Lens, n_layers: int | None = None) -> list[int]:
    """The layers of ``lens`` its artifact holds (:func:`artifact_payload`): all but the model's last (of
    ``n_layers``; default: the lens's record of it; all where neither says).

    Raises
    ------
    InvalidArgumentError
        No layer left.
    """
    n_layers = n_layers if n_layers is not None else lens.info.get("n_layers")
    layers = [int(x) for x in lens.layers if n_layers is None or int(x) < int(n_layers) - 1]
    if not layers:
        raise InvalidArgumentError(f"Expected a lens with a layer below the last ({int(n_layers or 0) - 1}). Got "
                                   f"layers {', '.join(map(str, lens.layers))}.")
    return layers


def export_lens(lens: Lens, out: str | Path, *, dtype: str = "float16", force: bool = False,
                gain: np.ndarray | None = None, n_layers: int | None = None) -> Path:
    """Write ``lens`` as an artifact file ``out`` (:func:`artifact_payload`): to a temporary file beside it, then
    renamed, so ``out`` is never half-written; ``out`` is checked by :func:`detjac.outputs.check_output` (an
    existing file replaced only with ``force``; InvalidArgumentError otherwise)."""
    import torch

    out = check_output(out, force=force)  # a new file, or a file replaced with force; never into a store or index
    payload = artifact_payload(lens, dtype=dtype, gain=gain, n_layers=n_layers)
    return write_output(out, lambda handle: torch.save(payload, handle))


def _load(path: Path) -> Any:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's unpickler raises many types on a file that is not its own  # noqa: BLE001
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise StoreFormatError(f"Expected a lens artifact readable by torch.load(weights_only=True) at {path}. Got "
                               f"a file it refuses: {first}") from None


def _matrices(found: Any, key: str, path: Path) -> dict[int, Any]:
    import torch

    if not isinstance(found, dict) or not found:
        raise StoreFormatError(f"Expected {key!r} to map layers to (d_model, d_model) tensors in {path}. Got "
                               f"{type(found).__name__}{' (empty)' if isinstance(found, dict) else ''}.")
    out = {}
    for layer, m in found.items():
        index = layer if type(layer) is int else parse_index(layer)
        if index is None or index < 0:
            raise StoreFormatError(f"Expected layer indices (non-negative integers) as the keys of {key!r} in "
                                   f"{path}. Got {layer!r}.")
        if not isinstance(m, torch.Tensor) or m.dim() != 2 or m.shape[0] != m.shape[1]:
            got = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise StoreFormatError(f"Expected {key}[{layer}] to be a square (d_model, d_model) tensor in {path}. "
                                   f"Got {got}.")
        _check_stored(m, f"{key}[{layer}]", path)
        out[index] = m
    shapes = sorted({tuple(m.shape) for m in out.values()})
    if len(shapes) > 1:
        raise StoreFormatError(f"Expected every matrix of {key!r} in {path} of one shape. Got {shapes}.")
    storages = {m.untyped_storage().data_ptr(): m.untyped_storage().nbytes() for m in out.values()}
    claimed = sum(m.numel() * m.element_size() for m in out.values())
    if claimed > sum(storages.values()):  # views of one storage: each passes, together they would expand
        raise StoreFormatError(f"Expected the matrices of {key!r} in {path} to store each of their values. Got "
                               f"{len(out)} matrices ({claimed} bytes) over {len(storages)} storage"
                               f"{'s' * (len(storages) > 1)} of {sum(storages.values())} bytes.")
    for layer, m in out.items():
        if not bool(torch.isfinite(m).all()):
            raise StoreFormatError(f"Expected finite values in {key}[{layer}] of {path}. Got "
                                   f"{int((~torch.isfinite(m)).sum())} non-finite values "
                                   f"(dtype {str(m.dtype).removeprefix('torch.')}).")
    return out


def _check_stored(m: Any, name: str, path: Path) -> None:
    """Refuse the tensor ``name`` unless it holds its values: not on the meta device, real floating point, and as
    many bytes of storage as values (a stride-0 ``expand`` of one number passes ``weights_only`` and would
    materialize gigabytes). Reads no value."""
    shape, dtype = tuple(m.shape), str(m.dtype).removeprefix("torch.")
    if m.device.type == "meta":
        raise StoreFormatError(f"Expected {name} of {path} to hold values. Got a meta-device tensor {shape}, which "
                               "has none.")
    if not m.is_floating_point():
        raise StoreFormatError(f"Expected real floating-point values in {name} of {path}. Got dtype {dtype}.")
    stored = m.untyped_storage().nbytes() - m.storage_offset() * m.element_size()
    if stored < m.numel() * m.element_size():
        raise StoreFormatError(f"Expected {name} of {path} to store each of its values. Got {shape} ({m.numel()} "
                               f"values) over {max(stored, 0)} bytes of storage (strides {tuple(m.stride())}), "
                               f"which would expand to {m.numel() * 8 / 2**30:.1f} GiB in float64.")


def _count(payload: dict[str, Any], key: str, path: Path) -> int:
    value = payload.get(key)
    if type(value) is not int or value < 1:
        raise StoreFormatError(f"Expected {key!r} to be a positive integer in {path}. Got {value!r}.")
    return value


def artifact_lens(path: str | Path) -> Lens:
    """The lens of an artifact or fit checkpoint file (see the module docstring), float64.

    Raises
    ------
    StoreFormatError
        A file ``torch.load(weights_only=True)`` refuses (a pickled object, not a torch file), or one without the
        artifact's or the checkpoint's keys, with matrices not square, of several sizes, or not finite, or a
        ``d_model``, ``source_layers`` or count that disagrees with them.
    """
    import torch

    from detjac.analysis import FINAL_BLOCK, LENS_VERSION, Lens

    path = Path(path)
    payload = _load(path)
    if not isinstance(payload, dict) or not ({"J", "jacobian_sum"} & set(payload)):
        keys = sorted(map(str, payload)) if isinstance(payload, dict) else type(payload).__name__
        raise StoreFormatError(f"Expected a Jacobian-lens artifact (keys J, n_prompts, source_layers, d_model) or a "
                               f"fit checkpoint (keys jacobian_sum, n_done) at {path}. Got {keys}.")
    checkpoint = "J" not in payload
    key = "jacobian_sum" if checkpoint else "J"
    found = _matrices(payload[key], key, path)
    d = int(next(iter(found.values())).shape[0])
    count = _count(payload, "n_done" if checkpoint else "n_prompts", path)
    if not checkpoint and payload.get("d_model") != d:
        raise StoreFormatError(f"Expected d_model to be the matrices' size ({d}) in {path}. Got "
                               f"{payload.get('d_model')!r}.")
    listed = payload.get("source_layers")
    if listed is not None and (not isinstance(listed, list | tuple) or sorted(map(int, listed)) != sorted(found)):
        raise StoreFormatError(f"Expected source_layers to list the layers of {key!r} ({sorted(found)}) in {path}. "
                               f"Got {listed!r}.")
    metadata = payload.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise StoreFormatError(f"Expected metadata to be a dict in {path}. Got {type(metadata).__name__}.")
    ours = metadata.get(DETJAC_KEY) if isinstance(metadata.get(DETJAC_KEY), dict) else {}
    layers = sorted(found)
    mean = np.stack([found[layer].to(torch.float64).numpy() for layer in layers])
    if checkpoint:
        mean = mean / count
    info = {"version": LENS_VERSION, "kind": ours.get("kind", "ordinary"), "estimator": ours.get("estimator", "jlens"),
            "target": FINAL_BLOCK, "model": ours.get("model") or {}, "n_prompts": count,
            "prompts_sha256": ours.get("prompts_sha256"), "source": str(path),
            "artifact": "fit checkpoint" if checkpoint else "artifact",
            "artifact_metadata": {k: v for k, v in metadata.items() if k != DETJAC_KEY}}
    if ours.get("n_layers") is not None:
        info["n_layers"] = ours["n_layers"]
    second = np.full_like(mean, np.nan)  # an artifact keeps the mean only: the spread is unknown, not zero
    return Lens(np.asarray(layers, dtype=np.int64), mean, second, np.full(len(layers), count, dtype=np.int64), info)


def hub_lens_file(spec: str) -> Path | None:
    """The cached file of ``org/name:path/in/repo`` (optionally ``org/name@revision:path``) in the local Hugging
    Face cache, resolved offline (``refs/<revision>`` then ``snapshots/<commit>/<path>``); None when ``spec`` is
    not of that form. CheckpointError when the repository, revision or file is not in the cache."""
    from detjac.engine import hub_cache_dir
    from detjac.errors import CheckpointError
    from detjac.model_names import is_hub_id

    match = re.fullmatch(r"([^:@]+)(?:@([^:]+))?:(.+)", spec)
    if match is None or not is_hub_id(match.group(1)) or Path(spec).exists():
        return None
    repo_id, revision, filename = match.group(1), match.group(2) or "main", match.group(3)
    if ".." in Path(filename).parts or filename.startswith("/"):
        raise InvalidArgumentError(f"Expected a file path inside the repository {repo_id}. Got {filename!r}.")
    cache = hub_cache_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = cached_commit(repo, repo_id, revision)  # a name, and a refs file that holds a commit hash
    found = repo / "snapshots" / (commit or "") / filename
    if commit is not None and found.exists():
        check_inside(found, repo, f"{filename} of {repo_id}")
    if commit is None or not found.is_file():
        got = f"no such file in snapshot {commit}" if commit else "no such revision" if repo.is_dir() else \
            f"no {repo.name}"
        raise CheckpointError(f"Expected {filename} of {repo_id} (revision {revision}) in the Hugging Face cache "
                              f"{cache}. Got {got}: fetch it with `hf download {repo_id} {filename} --revision "
                              f"{revision}` (detjac reads lenses from the cache only).")
    return found


def read_lens(source: str | Path) -> Lens:
    """Any lens detjac can use, by what ``source`` is: ``org/name:path`` in the Hugging Face cache
    (:func:`hub_lens_file`), a file (an artifact or a fit checkpoint: :func:`artifact_lens`), or a saved lens folder
    or a store with a fitted lens (:func:`detjac.analysis.load_lens`)."""
    from detjac.analysis import load_lens

    hub = hub_lens_file(str(source)) if isinstance(source, str) else None
    path = hub if hub is not None else Path(source)
    if path.is_file():
        return artifact_lens(path)
    return load_lens(path)
