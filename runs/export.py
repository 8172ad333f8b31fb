"""One Jacobian saved as a numpy ``.npz`` file (``detjac jacobian --out FILE.npz``).

Arrays: ``jacobian`` (row, token, col), ``embeddings`` (token, col), ``output`` (row,),
``reconstruction`` (row,), ``token_ids`` (token,), ``tokens`` (token,) decoded pieces (empty without
a tokenizer), ``bias`` (row,) for affine models, and the scalars ``reconstruction_error``,
``position``, ``detached``, ``model``, ``prompt``. ``numpy.load(path)["jacobian"][:, k, :]`` is
``J_k``; ``numpy.einsum("rtc,tc->r", J, embeddings)`` gives back ``reconstruction``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from detjac.errors import InvalidArgumentError


def check_npz_path(path: str | Path) -> Path:
    """``path`` if an .npz file can be written there (checked before any work), else InvalidArgumentError."""
    path = Path(path)
    if path.suffix.lower() != ".npz":
        raise InvalidArgumentError(f"Expected a file name ending in .npz. Got {str(path)!r}.")
    if not path.parent.is_dir():
        raise InvalidArgumentError(f"Expected an existing folder for {path}. Got none at {path.parent}.")
    return path


def save_result(result: Any, path: str | Path, *, model: str = "", tokens: list[str] | None = None) -> Path:
    """Write a :class:`~detjac.engine.JacobianResult` to ``path`` (``.npz``, compressed); returns the path.
    ``tokens``: the decoded pieces to save (default: the result's own)."""
    path = check_npz_path(path)

    def numpy(t: Any) -> np.ndarray:
        return t.detach().to("cpu").numpy()

    arrays = {"jacobian": numpy(result.jacobian), "embeddings": numpy(result.embeddings),
              "output": numpy(result.output), "reconstruction": numpy(result.reconstruction),
              "token_ids": np.asarray(result.token_ids, dtype=np.int64),
              "tokens": np.asarray(tokens or result.tokens or [], dtype=str),
              "reconstruction_error": np.float64(result.reconstruction_error), "position": np.int64(result.position),
              "detached": np.bool_(result.detached), "model": np.str_(model), "prompt": np.str_(result.prompt or "")}
    if getattr(result, "bias", None) is not None:
        arrays["bias"] = numpy(result.bias)
    np.savez_compressed(path, **arrays)
    return path
