"""``detjac svd``'s work, in one call (:func:`prompt_svd`): load the model, apply its Jacobian by products
(:func:`detjac.engine.jacobian_operator`), check one product, take the top triplets
(:func:`detjac.engine.operator_svd`), decode them to token ids, optionally compare with the full SVD of the formed
Jacobian and write the ``.npz`` file (whole or not at all, by :func:`detjac.store.write_npz`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detjac.engine import Engine, JacobianOperator
    from detjac.model_settings import LoadSpec


@dataclass(frozen=True)
class DecodedTriplet:
    """One singular triplet of ``J = [J_1 ... J_n]``: its value and residual, the top token ids of its left vector
    (through the unembedding), the token block carrying most of its right vector (``token``, with that ``share`` of
    ``|v|^2``) and that block's top token ids (through the input embedding)."""

    sigma: float
    residual: float
    left_ids: list[int]
    token: int
    share: float
    right_ids: list[int]


@dataclass(frozen=True)
class SvdSettings:
    """How :func:`prompt_svd` finds the triplets: ``detjac svd``'s options by the same names (``product_block`` vectors
    per product sweep, None: the engine's; ``position`` None: the last token)."""

    k: int = 16
    top: int = 6
    method: str = "lanczos"
    block: int = 8
    oversample: int = 8
    tol: float | None = None
    max_iters: int | None = None
    seed: int = 0
    product_block: int | None = None
    position: int | None = None


@dataclass
class SvdOutcome:
    """What :func:`prompt_svd` found: the engine and operator used, the one-product check's error, the SVD result
    (:func:`~detjac.engine.operator_svd`), its decoded triplets, the seconds up to the decoding, the comparison with
    the formed J's full SVD (``(seconds, values compared, largest relative error)``, or None) and the ``.npz`` file
    written (or None)."""

    engine: Engine
    op: JacobianOperator
    check_error: float
    result: Any
    triplets: list[DecodedTriplet]
    seconds: float
    compared: tuple[float, int, float] | None = None
    written: Path | None = None


def prompt_svd(spec: LoadSpec, text: str, settings: SvdSettings = SvdSettings(), *, compare: bool = False,
            out: str | Path | None = None, model_name: str = "", log: Callable[[Any], None] | None = None
            ) -> SvdOutcome:
    """``detjac svd``'s pipeline: the engine ``spec`` loads, the operator of ``text``, its one-product check, the top
    ``settings.k`` triplets decoded to ``settings.top`` tokens, with ``compare`` the formed J's full SVD beside them,
    with ``out`` (checked by the caller) the ``.npz`` file. ``log`` receives the operator once it is built, before
    the iterations start (the command prints its shape then)."""
    from detjac.engine import jacobian_operator, load_engine, operator_svd

    s = settings
    t0 = time.perf_counter()
    engine = load_engine(spec)
    op = jacobian_operator(engine, text, position=s.position, block=s.product_block, progress=spec.streamed_engine)
    if log is not None:
        log(op)
    err = op.check()
    result = operator_svd(op, s.k, method=s.method, block=s.block, oversample=s.oversample, tol=s.tol,
                          max_iters=s.max_iters, seed=s.seed, orient=op.produced, progress=True)
    outcome = SvdOutcome(engine, op, err, result, [], time.perf_counter() - t0)
    outcome.triplets = decoded_triplets(engine, op, result, s.top)
    if compare:
        outcome.compared = compare_svd(op, result)
    if out is not None:
        outcome.written = save_svd(out, op, result, model_name, text)
    return outcome


def decoded_triplets(engine: Engine, op: JacobianOperator, result: Any, top: int) -> list[DecodedTriplet]:
    """Each triplet of ``result`` (an :func:`~detjac.engine.operator_svd` of ``op``) decoded to its ``top`` tokens;
    a 16-bit engine's matrices decoded in float32 (``decoding_rows`` widens them: numpy has no bfloat16)."""
    from detjac.engine import decode_blocks, decode_top

    mats = engine.decoding_rows()  # streamed: read a chunk of the vocabulary at a time
    left_ids, _ = decode_top(result.U.cpu(), mats["unembedding"], top)
    right_ids, _, picks, shares = decode_blocks(result.V.cpu(), op.n_tokens, mats["embedding"], top)
    return [DecodedTriplet(float(s), float(result.residuals[i]), left_ids[i].tolist(), int(picks[i]),
                           float(shares[i]), right_ids[i].tolist()) for i, s in enumerate(result.S.tolist())]


def compare_svd(op: JacobianOperator, result: Any) -> tuple[float, int, float]:
    """Form ``J`` by row blocks with the same engine, take its full SVD and compare (what the products avoid).

    Returns
    -------
    tuple of (float, int, float)
        Seconds taken, the number of singular values compared, and their largest relative error.
    """
    import torch

    from detjac.engine import jacobian

    t0 = time.perf_counter()
    J = jacobian(op.engine, op.token_ids, position=op.position).jacobian
    S = torch.linalg.svdvals(J.reshape(J.shape[0], -1))[: result.S.shape[0]].to(result.S.device)
    rel = float(((result.S - S).abs() / S).max())
    return time.perf_counter() - t0, int(S.shape[0]), rel


def save_svd(path: str | Path, op: JacobianOperator, result: Any, model: str, text: str) -> Path:
    """Write U (d, k), S (k,), V (token, d, k), the residuals, the token ids and the settings to the ``.npz`` file
    ``path`` (checked by the caller)."""
    import numpy as np

    from detjac.store import write_npz

    arrays = {"U": result.U, "S": result.S, "V": result.right_blocks(op.n_tokens).permute(1, 2, 0),
              "residuals": result.residuals}
    write_npz(Path(path), {**{k: v.detach().cpu().numpy() for k, v in arrays.items()},
                           "token_ids": np.asarray(op.token_ids, dtype=np.int64), "position": np.int64(op.position),
                           "model": np.str_(model), "prompt": np.str_(text), "method": np.str_(result.method),
                           "matvecs": np.int64(result.matvecs), "rmatvecs": np.int64(result.rmatvecs),
                           "converged": np.bool_(result.converged)})
    return Path(path)
