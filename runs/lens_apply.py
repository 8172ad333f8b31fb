"""The lens on a model: a new prompt's layer states decoded through fitted lenses, and their evaluation.

The torch side of :mod:`detjac.analysis.lens`: the layer-streamed engine runs the prompt's forward pass
(every layer's output ``h_L`` at every position, the final norm of each, the output ``y`` at the target
position) and, for the exact per-prompt map, the prompt's own ``to_output.L`` Jacobians (``d`` pullbacks
per prompt: the expensive part, skipped with ``exact=False``). The readings and their scores are numpy,
in :mod:`detjac.analysis.lens`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from detjac.errors import InvalidArgumentError

if TYPE_CHECKING:
    from detjac.engine import Engine


@dataclass
class PromptStates:
    """One prompt through the model: ``states[L]`` (n, d) layer L's output, ``normed[L]`` (n, d) its final norm
    (each position's scale from its own vector), ``output`` (d,) ``y`` at ``position``, ``exact[L]`` (d, n, d) the
    prompt's ``to_output.L`` Jacobian (empty without ``exact``), ``final`` (n, d) the final normed states,
    ``norm`` the model's final norm on numpy vectors (..., d), each scale from its own vector."""

    token_ids: list[int]
    position: int
    states: dict[int, np.ndarray]
    normed: dict[int, np.ndarray]
    output: np.ndarray
    final: np.ndarray
    exact: dict[int, np.ndarray]
    norm: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False)


def check_lens_kinds(lenses: dict[str, Any]) -> None:
    """Each lens is of the kind its role names: ``detached lens`` of detached Jacobians, ``ordinary lens`` of
    ordinary ones (InvalidArgumentError naming both otherwise: they would be labelled swapped)."""
    for role, lens in lenses.items():
        wanted = role.split()[0]
        if wanted in ("detached", "ordinary") and lens.kind != wanted:
            raise InvalidArgumentError(f"Expected the {role} to be fitted on {wanted} Jacobians. Got a lens of "
                                       f"{lens.kind} Jacobians ({lens.info.get('source') or 'a saved lens'}).")


def recorded_model(lens: Any) -> str | None:
    """The model ``lens`` records (``info["model"]["model_path"]``: where it was found when the lens was fitted, or
    ``default``) when it is found on this machine, else None: a lens carries its model, so ``lens apply`` and
    ``lens export`` need no ``--model`` (:func:`check_lens_model` still checks its digests against the lens's)."""
    path = (lens.info.get("model") or {}).get("model_path")
    if not isinstance(path, str) or not path:
        return None
    from pathlib import Path

    return path if path == "default" or Path(path).exists() else None


LENS_LOAD = {"dtype": "float64", "streamed": True}  # how every lens reads a model: its exact states, layer by layer


def check_lens_model(engine: Engine, lenses: Sequence[Any]) -> Engine:
    """``engine`` (loaded float64 and layer-streamed, :data:`LENS_LOAD`: a lens reads the exact states) when it is
    the model the lenses were fitted on: same hidden size, fitted layers within the model, the lens's config SHA-256
    (when the checkpoint folder has a ``config.json``) and its weights SHA-256 (when both the lens and the model have
    one: the same config with other weights is another model).

    Raises
    ------
    InvalidArgumentError
        A lens fitted on another model, naming both.
    """
    import hashlib

    from .fingerprint import weights_identity

    ref = engine.model_ref
    source, model = ref.source, ref.name
    config = source / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
    weights = weights_identity(source).get("weights_sha256")
    for lens in lenses:
        fitted = lens.info.get("model", {}).get("weights_sha256")
        if weights and fitted and fitted != weights:
            raise InvalidArgumentError(
                f"Expected a lens fitted on the weights of {model} (SHA-256 {weights[:12]}…). Got one fitted on "
                f"weights {fitted[:12]}… ({lens.info.get('model', {}).get('model_id')}): another model, even if "
                "its config is the same.")
    for lens in lenses:
        d, layers = lens.mean.shape[-1], [int(x) for x in lens.layers]
        fitted = lens.info.get("model", {}).get("config_sha256")
        if d != engine.d_model or max(layers) >= engine.n_layers or (digest and fitted and fitted != digest):
            raise InvalidArgumentError(
                f"Expected a lens fitted on {model} (d_model {engine.d_model}, {engine.n_layers} layers, config "
                f"SHA-256 {digest}). Got one of d_model {d}, layers {layers}, config SHA-256 {fitted} (fitted on "
                f"{lens.info.get('model', {}).get('model_id')}).")
    return engine


def prompt_states(engine: Engine, prompt: Any, layers: Iterable[int], exact: bool = True) -> PromptStates:
    """Run ``prompt`` through ``engine`` (a :class:`~detjac.engine.StreamedEngine`) at ``layers``."""
    import torch

    from detjac.engine import assemble
    from detjac.targets import Target

    trace = engine.trace(prompt)
    layers = sorted(set(layers))
    as_np = lambda t: t.detach().to("cpu", torch.float64).numpy()  # noqa: E731
    states = {layer: trace.inputs[layer + 1] for layer in layers}
    out = PromptStates(list(trace.token_ids), trace.position, {k: as_np(v) for k, v in states.items()},
                       {k: as_np(trace.norm(v)) for k, v in states.items()}, as_np(trace.output),
                       as_np(trace.norm(trace.inputs[engine.n_layers])), {}, final_norm(trace))
    if exact:
        targets = [Target(layer, "to_output") for layer in layers]
        jacobians = assemble(engine, trace, targets, engine.plan(trace, targets))
        out.exact = {t.layer: as_np(J) for t, J in jacobians.items()}
    return out


def final_norm(trace: Any) -> Callable[[np.ndarray], np.ndarray]:
    """The final norm of ``trace``'s model on float64 numpy vectors (..., d), each with its scale from itself."""
    import torch

    def norm(v: np.ndarray) -> np.ndarray:
        ref = trace.inputs[0]
        with torch.no_grad():
            out = trace.norm(torch.as_tensor(v, dtype=ref.dtype, device=ref.device))
        return out.detach().to("cpu", torch.float64).numpy()

    return norm


def unembedding(engine: Engine) -> Any:
    """(vocab, d) the matrix that turns a final normed state into logits, float64: a numpy array, or its rows read
    on demand where the engine keeps a memory budget (:meth:`~detjac.engine.Engine.decoding_rows`); scored a chunk
    of the vocabulary at a time (:func:`detjac.singular.rank_of`, :func:`~detjac.singular.decode_top`)."""
    import torch

    return engine.decoding_rows(torch.float64)["unembedding"]


def score_prompt(engine: Engine, lenses: dict[str, Any], prompt: Any, W_U: Any, layers: Sequence[int],
                 exact: bool = True) -> tuple[PromptStates, list[dict[str, Any]]]:
    """One prompt's rows: per layer and method, the rank of the model's prediction at the target position and the
    relative error of the output read (:func:`detjac.analysis.score_lens`)."""
    from detjac.analysis import lens_readings, score_lens

    st = prompt_states(engine, prompt, layers, exact)
    rows = []
    for layer in layers:
        read = lens_readings(lenses, layer, st.states[layer], st.normed[layer][st.position], st.position,
                        st.exact.get(layer), st.norm)
        for method, result in score_lens(read, W_U, st.output).items():
            rows.append({"layer": layer, "method": method, **result})
    return st, rows


def position_ranks(lenses: dict[str, Any], st: PromptStates, W_U: Any, layers: Sequence[int]
                   ) -> dict[str, np.ndarray]:
    """Per method (each lens, ``logit``), (layers, n) ranks of the model's own prediction at every position."""
    from detjac.analysis import lens_reading
    from detjac.singular import decode_top, rank_of

    predicted = decode_top(np.asarray(st.final).T, W_U, 1)[0][:, 0]  # (n,) argmax, the first of ties
    reads = {name: lambda layer, lens=lens: lens_reading(lens, layer, st.states[layer], st.norm)
             for name, lens in lenses.items()}
    reads["logit"] = lambda layer: st.normed[layer]
    return {method: np.array([rank_of(np.asarray(read(layer)).T, W_U, predicted) for layer in layers])
            for method, read in reads.items()}


def evaluate_lenses(engine: Engine, lenses: dict[str, Any], prompts: Sequence[str], layers: Sequence[int], *,
             exact: int | None = None, progress: Any = None) -> list[dict[str, Any]]:
    """Rows of :func:`score_prompt` over ``prompts`` (each with its ``prompt`` index); the exact per-prompt map
    (``self``, ``exact``) for the first ``exact`` prompts only (None: all; 0: none)."""
    W_U = unembedding(engine)
    rows = []
    for i, text in enumerate(prompts):
        _, got = score_prompt(engine, lenses, text, W_U, layers, exact is None or i < exact)
        rows += [{"prompt": i, **r} for r in got]
        if progress is not None:
            progress.update()
    return rows


JLENS_SKIP, JLENS_MAX_TOKENS = 16, 128  # the jlens estimator's valid positions: the first 16 and the last left out


def jlens_token_ids(engine: Engine, prompt: Any, *, bos: bool = True, max_tokens: int = JLENS_MAX_TOKENS
                    ) -> list[int]:
    """The tokens a ``jlens`` fit reads of ``prompt``: the tokenizer's, with its BOS token put first when ``bos`` and
    the tokenizer did not (TransformerLens' ``to_tokens`` default), cut at ``max_tokens``."""
    ids = list(engine.token_ids(prompt))
    bos_id = getattr(engine.tokenizer, "bos_token_id", None) if bos else None
    if bos_id is not None and (not ids or ids[0] != bos_id):
        ids = [int(bos_id), *ids]
    return ids[:max_tokens]


def jlens_prompt(engine: Engine, prompt: Any, layers: Sequence[int], *, skip: int = JLENS_SKIP,
                 max_tokens: int = JLENS_MAX_TOKENS, bos: bool = True) -> dict[int, np.ndarray] | None:
    """One text's ``jlens`` estimate per layer, by the reference's conventions (TransformerLens 4.3.0
    ``JacobianLens.fit``): with ``V`` the valid positions ``skip .. n-2`` of the text cut at ``max_tokens``, the mean
    over source positions ``k`` in ``V`` of ``sum_{p' in V, p' >= k} dh_{final,p'} / dh_{L,k}`` (d, d), float64,
    where ``h_final`` is the last layer's output before the final norm; from the layer-streamed engine's pullback
    (exact for its model, detached or ordinary). Rows index the final block's output, columns layer ``L``'s output.
    The text's tokens: :func:`jlens_token_ids`. None when no position is valid."""
    import torch

    from detjac.engine import pull_final_block

    ids = jlens_token_ids(engine, prompt, bos=bos, max_tokens=max_tokens)
    n, d = len(ids), engine.d_model
    if n - 1 <= skip:
        return None
    trace = engine.trace(ids)
    rows = max(1, min(d, (128 * 2**20) // (n * d * 8)))  # a block of cotangents ~128 MiB at one layer
    eye = torch.eye(d, dtype=engine.dtype, device=engine.device)
    valid = range(skip, n - 1)
    out = {layer: np.empty((d, d)) for layer in layers}
    for r0 in range(0, d, rows):
        means = pull_final_block(engine, trace, eye[r0:r0 + rows], layers, valid,
                                 reduce=lambda b: b[:, skip:n - 1].mean(1))
        for layer, mean in means.items():
            out[layer][r0:r0 + rows] = mean.to("cpu", torch.float64).numpy()
    return out


def texts_digest(texts: Sequence[str]) -> str:
    """SHA-256 of a ``jlens`` lens's texts in order, as ``info["prompts_sha256"]`` keeps it."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(list(texts)).encode()).hexdigest()


def jlens_fitted_on(lens: str | Path, texts: str | Path) -> bool:
    """Whether ``lens`` is a complete saved ``jlens`` lens of today's conventions (onto the final block's output)
    fitted on exactly the texts of the prompts file ``texts``: a stopped series of fits resumes after its last finished
    one (a lens is written sealed, so a partial or damaged one does not load and is fitted again)."""
    from detjac.analysis import load_lens
    from detjac.errors import DetjacError

    from .prompts import read_prompts

    if not Path(lens).exists():
        return False
    try:
        info = load_lens(lens).info
    except (DetjacError, OSError):  # unfinished or damaged: fit it again (`lens fit --force` replaces it)
        return False
    same_texts = info.get("prompts_sha256") == texts_digest([p.text for p in read_prompts(texts, "txt").prompts])
    return same_texts and info.get("target") == "final_block"  # a lens of the conventions before is fitted again


def fit_jlens(engine: Engine, prompts: Sequence[str], layers: Sequence[int], model_info: dict[str, Any], *,
              skip: int = JLENS_SKIP, max_tokens: int = JLENS_MAX_TOKENS, bos: bool = True,
              progress: Any = None) -> Any:
    """The ``jlens`` lens of ``prompts``: per layer, the mean over texts of :func:`jlens_prompt` (texts with no
    source position left are not counted), with its element-wise second moment, as a
    :class:`~detjac.analysis.lens.Lens` (``info["estimator"] == "jlens"``).

    Raises InvalidArgumentError when no text has a source position."""
    from detjac import __version__
    from detjac.analysis import FINAL_BLOCK, LENS_VERSION, Lens

    d = engine.d_model
    mean, second = np.zeros((len(layers), d, d)), np.zeros((len(layers), d, d))
    counted = 0
    for text in prompts:
        est = jlens_prompt(engine, text, layers, skip=skip, max_tokens=max_tokens, bos=bos)
        if est is not None:
            counted += 1
            for i, layer in enumerate(layers):
                mean[i] += est[layer]
                second[i] += est[layer] ** 2
        if progress is not None:
            progress.update()
    if not counted:
        raise InvalidArgumentError(f"Expected texts longer than {skip + 1} tokens for the jlens estimator (it leaves "
                                   f"out the first {skip} positions and the last). Got {len(prompts)} shorter ones.")
    info = {"version": LENS_VERSION, "kind": "detached" if engine.detach else "ordinary", "estimator": "jlens",
            "target": FINAL_BLOCK, "operator": "mean over texts and valid source positions k of "
            f"sum_{{p' valid, p' >= k}} dh_final,p'/dh_{{L,k}} (h_final: the last layer's output before the final "
            f"norm; valid: positions {skip} .. n-2 of the text cut at {max_tokens} tokens)",
            "skip_first_positions": skip, "max_seq_len": max_tokens, "bos": bos, "n_layers": engine.n_layers,
            "model": model_info, "n_prompts": counted,
            "skipped_prompts": len(prompts) - counted,
            "prompts_sha256": texts_digest(prompts),
            "detjac_version": __version__}
    count = np.full(len(layers), counted, dtype=np.int64)
    return Lens(np.asarray(layers, dtype=np.int64), mean / counted, second / counted, count, info)
