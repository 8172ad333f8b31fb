"""``detjac lens fit --estimator jlens``: Gurnee et al.'s lens of a file of texts (:func:`detjac.runs.fit_jlens`),
computed from the model and saved as a lens folder; the target is checked before the model loads, and the folder is
written whole or not at all (:func:`detjac.analysis.save_lens`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from detjac.analysis import Lens


def fit_jlens_folder(path: str | Path, prompts_path: str | Path, model: str, *, gguf_file: str | None = None,
                     layers: list[int] | None = None, ordinary: bool = False, force: bool = False, bos: bool = True,
                     device: str = "cpu") -> tuple[Lens, Path, list[int]]:
    """Fit the ``jlens`` lens of the texts in ``prompts_path`` (one per line) on ``model`` and save it at ``path``.

    Parameters
    ----------
    path : str or Path
        The lens folder to write (an existing lens replaced only with ``force``).
    prompts_path : str or Path
        A text file, one text per line.
    model, gguf_file : str
        The model (a folder, hub id, GGUF file or ``default``), loaded layer-streamed in float64 on ``device``.
    layers : list of int or None
        The layers (negative ones count from the end); None: 0 .. L-2, as the reference fits them (at the last layer
        the transport onto its own output is the identity).
    ordinary : bool
        Fit on the ordinary Jacobian instead of the detached one.
    bos : bool
        Put the tokenizer's beginning-of-sequence token before each text.

    Returns
    -------
    tuple of (Lens, Path, list[int])
        The lens, where it was written, and its layers.
    """
    from detjac.analysis import check_lens_target, save_lens
    from detjac.engine import ModelRef, load_engine
    from detjac.progress import tqdm
    from detjac.targets import layer_index

    from .fingerprint import weights_identity
    from .lens_apply import fit_jlens
    from .prompts import read_prompts

    check_lens_target(path, force, reads=[("the prompts file", prompts_path)])  # before the model loads
    texts = [p.text for p in read_prompts(prompts_path, "txt").prompts]  # one per line; refuses an empty file
    ref = ModelRef.resolve(model, gguf_file, None)
    engine = load_engine(ref, streamed=True, dtype="float64", detach=not ordinary, device=device)
    chosen = sorted({layer_index(i, engine.n_layers) for i in layers}) if layers else list(range(engine.n_layers - 1))
    info = {"model_id": ref.name, "model_path": ref.location, "model_type": engine.config.model_type,
            "dtype": "float64", "detach": not ordinary,
            "weights_sha256": weights_identity(ref.source).get("weights_sha256")}
    with tqdm(total=len(texts), desc="jlens fit", unit="text") as bar:
        fitted = fit_jlens(engine, texts, chosen, info, bos=bos, progress=bar)
    return fitted, save_lens(fitted, path, force=force), chosen
