"""One Jacobian saved as a numpy ``.npz`` file (``detjac jacobian --out FILE.npz``).

Arrays ``jacobian`` (row, token, col), ``embeddings`` (token, col), ``output``, ``reconstruction``, ``token_ids``,
``tokens``, ``bias`` (affine models) and the run's scalars: ``numpy.load(path)["jacobian"][:, k, :]`` is ``J_k``, and
``numpy.einsum("rtc,tc->r", J, embeddings)`` gives back ``reconstruction``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from detjac.outputs import check_output


def save_result(result: Any, path: str | Path, *, model: str = "", tokens: list[str] | None = None,
                force: bool = False) -> Path:
    """Write a :class:`~detjac.engine.JacobianResult` to ``path`` (``.npz``, compressed, written aside and renamed
    into place); returns the path. ``tokens``: the decoded pieces to save (default: the result's own); an existing
    file is replaced only with ``force``."""
    from detjac.store import write_npz

    path = check_output(path, force=force, suffix=".npz")  # before anything is written

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
    return write_npz(path, arrays, compressed=True)
