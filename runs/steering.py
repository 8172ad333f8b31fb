"""Steering from a store (``detjac steer``): a concept prompt's stored layer Jacobians steer a loaded model.

:func:`load_concept`, :func:`steer_prompt`, :func:`prepare_evaluation` and :func:`evaluate_steering`; the steering
itself is :mod:`detjac.engine.tools.steer`'s (docs/engine.md, "Steering")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detjac.errors import InvalidArgumentError
from detjac.model_settings import LoadSpec

if TYPE_CHECKING:
    from detjac.engine import ModelRef
    from detjac.store import StoredPrompt, StoreReader


@dataclass(frozen=True)
class ConceptSession:
    """A loaded model, its tokenizer and the steering operator of a stored concept prompt."""

    model: Any
    tokenizer: Any
    operator: Any  # detjac.engine.tools.steer.SteeringOperator


@dataclass(frozen=True)
class SteeredText:
    """One prompt's greedy continuations, unsteered and steered at ``strength``, as text."""

    prompt: str
    strength: float
    unsteered: str
    steered: str


@dataclass(frozen=True)
class SteeringEvaluation:
    """The prompts of a measurement and the concept's token ids (with their texts, sorted by id)."""

    prompts: list[str]
    concept_ids: set[int]
    concept_tokens: list[str]


@dataclass(frozen=True)
class SteeringTable:
    """One row per strength (see :func:`detjac.engine.tools.steer.evaluate`) and the table file, when written."""

    rows: list[dict[str, Any]]
    table: Path | None = None


def concept_operator(store: StoreReader, prompt_id: str, layer: int, model: Any, method: str = "detjac") -> Any:
    """The steering operator from a stored prompt's layer-``layer`` Jacobian, checked against ``model``.

    ``detjac`` takes ``layer.<layer>``; ``paper`` takes ``layer_normed.<layer>`` (the reference's operators:
    the layer's output through the final norm frozen at its own value) or, when only ``layer.<layer>`` is
    stored, ``diag(g) layer.<layer>`` with ``g`` the stored final-norm gain: the two differ by the positive
    factor ``1 / rms`` of the concept's state, which the method's normalization removes, so they steer alike.

    Parameters
    ----------
    store : JacobianStore
        A store written by ``detjac run --layers`` with this model.
    prompt_id : str
        The concept prompt.
    layer : int
        The steered layer; negative counts from the end.
    model : transformers model
        Its input embeddings must be the store's (to within 1 % in norm).
    method : {"detjac", "paper"}
        See :mod:`detjac.engine.tools.steer`.

    Returns
    -------
    SteeringOperator

    Raises
    ------
    InvalidArgumentError
        For an unknown method, a layer out of range, a prompt without the Jacobian the method needs, or a
        store of another model.
    """
    import numpy as np
    import torch

    from detjac.engine import SteeringOperator

    SteeringOperator.check_method(method)
    prompt = store.get(prompt_id)
    n_layers = model.config.get_text_config().num_hidden_layers
    if not -n_layers <= layer < n_layers:
        raise InvalidArgumentError(f"Expected a layer in [-{n_layers}, {n_layers}). Got {layer}.")
    layer %= n_layers
    J = _method_jacobian(store, prompt, layer, method)
    stored = store.model_array("embedding").astype(np.float64)
    mine = model.get_input_embeddings().weight.detach().to("cpu", torch.float64).numpy()
    if stored.shape != mine.shape or np.linalg.norm(stored - mine) > 1e-2 * np.linalg.norm(mine):
        raise InvalidArgumentError(f"Expected the store's model to be this model. Got input embeddings of shape "
                                   f"{stored.shape} in the store and {mine.shape} in the model, or different values.")
    return SteeringOperator.from_jacobian(layer, torch.from_numpy(J).to(model.dtype), prompt.prompt, method)


def _method_jacobian(store: StoreReader, prompt: StoredPrompt, layer: int, method: str) -> Any:
    """(d, n, d) the stored operators a method steers with (see :func:`concept_operator`), float64."""
    import numpy as np

    from detjac.errors import StoreError

    stored = prompt.layerwise_targets
    if method == "paper" and f"layer_normed.{layer}" in stored:
        return np.asarray(prompt.layerwise(f"layer_normed.{layer}", lazy=False), dtype=np.float64)
    gain = None
    if method == "paper":
        try:
            gain = store.model_array("final_norm").astype(np.float64)
        except StoreError:
            gain = None
    if f"layer.{layer}" not in stored or (method == "paper" and gain is None):
        wanted = "layer_normed" if method == "paper" else "layer"
        raise InvalidArgumentError(
            f"Expected the layerwise Jacobian {wanted}.{layer} with prompt {prompt.id} for --method {method}. Got "
            f"{', '.join(stored) or 'no layerwise Jacobians'}: run `detjac run MODEL CONCEPT.txt --out STORE "
            f"--layers {layer} --components {wanted}`.")
    J = np.asarray(prompt.layerwise(f"layer.{layer}", lazy=False), dtype=np.float64)
    return J if gain is None else gain[:, None, None] * J


def load_concept(model: LoadSpec | ModelRef | str, store_path: str | Path, prompt_id: str, layer: int, *,
                 dtype: str = "float32", device: str = "cpu", method: str = "detjac", revision: str | None = None,
                 trust_remote_code: bool = False) -> ConceptSession:
    """Load ``model`` (a :class:`~detjac.model_settings.LoadSpec`, which then says how; or a checkpoint folder or
    ``default``, loaded in ``dtype`` on ``device``) in memory and the ``method``'s operator of ``prompt_id`` in the
    store.

    Raises
    ------
    InvalidArgumentError
        When the model has no tokenizer, or as :func:`concept_operator`.
    """
    from detjac.engine import ModelRef, SteeringOperator, load_engine
    from detjac.store import open_store

    SteeringOperator.check_method(method)  # before the model loads
    spec = model if isinstance(model, LoadSpec) else LoadSpec(
        model=ModelRef.of(model, revision), dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    ref, store = spec.model, open_store(store_path)
    check_same_model(store, ref.source, ref.name)
    engine = load_engine(spec)  # in memory: steering generates with the whole model
    lm, tok = engine.model, engine.tokenizer
    if tok is None:
        raise InvalidArgumentError(f"Expected a tokenizer with {ref.name} to encode prompts. Got none.")
    return ConceptSession(lm, tok, concept_operator(store, prompt_id, layer, lm, method))


def check_same_model(store: StoreReader, source: Any, model: str) -> None:
    """Refuse a store whose run recorded another model than ``source`` (config, weights or tokenizer digests that
    differ), naming both; a store or model without a digest is checked by what both have."""
    from pathlib import Path

    from detjac.store import model_differences

    from .fingerprint import model_identity

    differences = model_differences(store.run, model_identity(source), (Path(store.path).name, model))
    if differences:
        raise InvalidArgumentError(
            f"Expected a store of the model {model}. Got {Path(store.path).name}, written with "
            f"{store.run.get('model_id')}: " + "; ".join(differences) + ".")


def steer_prompt(session: ConceptSession, prompt: str, strength: float, max_new_tokens: int = 24) -> SteeredText:
    """Greedy continuations of ``prompt``, without steering and with it at ``strength``."""
    from detjac.engine import generate

    tok, lm = session.tokenizer, session.model
    ids = tok(prompt)["input_ids"]
    return SteeredText(prompt, strength, tok.decode(generate(lm, ids, max_new_tokens)),
                       tok.decode(generate(lm, ids, max_new_tokens, session.operator, strength)))


def concept_ids(tokenizer: Any, concept: str, words: str | None = None) -> set[int]:
    """The token ids counted as the concept.

    With ``words`` (comma-separated), the first token of each word (leading spaces matter);
    else every token of the ``concept`` prompt whose text has at least 4 letters.
    """
    if words is not None:
        return {first for w in words.split(",") if w
                for first in tokenizer(w, add_special_tokens=False)["input_ids"][:1]}
    return {t for t in tokenizer(concept)["input_ids"] if sum(c.isalpha() for c in tokenizer.decode([t])) >= 4}


def prepare_evaluation(session: ConceptSession, prompts_path: str | Path,
                       words: str | None = None) -> SteeringEvaluation:
    """Read the prompts (one per line, blank lines skipped) and pick the concept tokens (:func:`concept_ids`).

    Raises
    ------
    PromptsFileError
        When the file holds only blank lines (or is missing, or not UTF-8). Lines end at ``\n`` only, as in every
        prompts file (:func:`detjac.runs.prompts.read_prompts`).
    """
    from .prompts import read_prompts

    prompts = [p.text.strip() for p in read_prompts(prompts_path, "txt").prompts]  # split as every prompts file
    ids = concept_ids(session.tokenizer, session.operator.concept, words)
    return SteeringEvaluation(prompts, ids, [session.tokenizer.decode([t]) for t in sorted(ids)])


def evaluate_steering(session: ConceptSession, evaluation: SteeringEvaluation, strengths: Sequence[float],
                      max_new_tokens: int = 24, table: str | Path | None = None,
                      progress: bool = True) -> SteeringTable:
    """How often the concept's tokens appear in the continuations of every prompt at every strength.

    One row per strength (:func:`detjac.engine.tools.steer.evaluate`), written to ``table`` when
    given (Parquet for a ``.parquet`` suffix, else CSV).

    Raises
    ------
    InvalidArgumentError
        When there is no concept token to count.
    """
    from detjac.analysis import write_table
    from detjac.engine import evaluate

    rows = evaluate(session.model, session.tokenizer, session.operator, evaluation.prompts, strengths,
                    evaluation.concept_ids, max_new_tokens, progress=progress)
    return SteeringTable(rows, write_table(rows, table) if table else None)
