"""``detjac lens export``: a lens (a saved folder, a store's fit, an artifact) written as the reference's Jacobian-lens
artifact (:mod:`detjac.runs.lens_artifact`), with what the format needs from the model (the final norm's gain for a
lens onto the final normed state, the layer count to leave the last layer out) read from the model the lens records
or the one given. Nothing is written unless the model is the lens's (by ``d_model``) and the file can be complete."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detjac.errors import InvalidArgumentError
from detjac.outputs import check_output

from .lens_apply import recorded_model
from .lens_artifact import artifact_layers, export_lens, read_lens

if TYPE_CHECKING:
    from detjac.analysis import Lens


@dataclass(frozen=True)
class ExportedLens:
    """What :func:`export_lens_file` wrote: the lens it read, the file and the layers it holds."""

    lens: Lens
    path: Path
    layers: list[int]


def export_lens_file(lens_path: str, out: str | Path, *, dtype: str = "float16", model: str | None = None,
                     gguf_file: str | None = None, force: bool = False) -> ExportedLens:
    """Write the lens at ``lens_path`` as an artifact file ``out``.

    Parameters
    ----------
    lens_path : str
        A saved lens folder, a store with a fitted lens, an artifact file, or ``ORG/NAME:FILE`` of the hub cache.
    out : str or Path
        A new file (or one ``force`` replaces).
    dtype : str
        ``float16`` (the reference's default) or ``float32``.
    model, gguf_file : str or None
        The model the lens was fitted on (default: the one it records, read only where the format needs it).

    Returns
    -------
    ExportedLens

    Raises
    ------
    InvalidArgumentError
        A model of another ``d_model``, a final norm without a plain gain for a lens onto the normed state, or no
        model where the lens records no layer count (and the errors of :func:`export_lens`).
    """
    if Path(lens_path).exists():  # a lens on this machine (not ORG/NAME:FILE of the cache): not overwritten
        check_output(out, force=force, reads=[("the lens", lens_path)])
    found = read_lens(lens_path)
    gain = n_layers = None
    if model is None and gguf_file is None and (not found.before_norm or found.info.get("n_layers") is None):
        model = recorded_model(found)  # a lens carries its model: --model only overrides it
    if model is not None:
        gain, n_layers = _model_facts(found, model, gguf_file)
    elif found.info.get("n_layers") is None:
        raise InvalidArgumentError("Expected --model: the lens records neither the model's layer count nor a model "
                                   "found on this machine, and the format leaves the last layer out.")
    written = export_lens(found, out, dtype=dtype, force=force, gain=gain, n_layers=n_layers)
    return ExportedLens(found, written, artifact_layers(found, n_layers))


def _model_facts(found: Lens, model: str, gguf_file: str | None) -> tuple[Any, int]:
    """The final norm's gain (None for a norm without a plain one) and the layer count of ``model``, checked to be
    the lens's by ``d_model``."""
    import torch

    from detjac.engine import ModelRef, load_engine

    engine = load_engine(ModelRef.resolve(model, gguf_file, None), streamed=True, dtype=torch.float64)
    if engine.d_model != found.mean.shape[-1]:
        raise InvalidArgumentError(f"Expected the model the lens was fitted on (d_model {found.mean.shape[-1]}). Got "
                                   f"{model}, of d_model {engine.d_model}.")
    gain = engine.decoding_matrices(torch.float64).get("final_norm")
    gain = None if gain is None else gain.numpy()
    if gain is None and not found.before_norm:
        raise InvalidArgumentError(f"Expected a final norm with a plain gain in {model} to write a lens onto the final "
                                   "normed state in the format. Got a norm without one (a centring LayerNorm).")
    return gain, engine.n_layers
