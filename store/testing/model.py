"""The synthetic model of :mod:`detjac.store.testing`: its matrices and tokenizer, the run description a real run
writes, and each prompt's exact arrays (the truth, in float64)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import __version__
from ...targets import Target
from .. import Keep, prompt_id

UNK = "[UNK]"
WORDS = ("the", "oak", "tree", "harp", "whale", "bread", "copper", "violin", "kitten", "young", "cat", "metal",
         "sea", "grows", "plays", "a", "of", "is", "and", "in")
EPS = 1e-6  # the final norm's epsilon
LOW_RANK_PASSES = 3  # as runs/batch.py


@dataclass(frozen=True)
class SyntheticModel:
    """The matrices kept under ``model/`` and the tokenizer of a synthetic store."""

    embedding: np.ndarray  # (vocab, d)
    unembedding: np.ndarray  # (vocab, d)
    final_norm: np.ndarray | None  # (d,)
    words: tuple[str, ...]  # the vocabulary, by id
    tokenizer: bool = True

    @property
    def d_model(self) -> int:
        return self.embedding.shape[1]

    def tokenizer_json(self) -> str:
        """A word-level ``tokenizers`` tokenizer over :attr:`words` (unknown words become ``[UNK]``)."""
        from tokenizers import Tokenizer, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(self.words)}, unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return tok.to_str()

    def tokenize(self, text: str) -> list[int]:
        ids = {w: i for i, w in enumerate(self.words)}
        return [ids.get(w, 0) for w in text.split()]

    def model_data(self, storage: str) -> tuple[dict[str, np.ndarray], dict[str, bytes]]:
        """What ``create_store(model_data=...)`` is given by a real run (``runs/plan.py:model_for_decoding``)."""
        arrays = {"embedding": self.embedding, "unembedding": self.unembedding}
        if self.final_norm is not None:
            arrays["final_norm"] = self.final_norm
        files = {"tokenizer.json": self.tokenizer_json().encode()} if self.tokenizer else {}
        return {k: v.astype(storage) for k, v in arrays.items()}, files


@dataclass
class LayerwiseTruth:
    jacobian: np.ndarray  # (d, n, d)
    output: np.ndarray  # (d,)
    inputs: np.ndarray | None  # (n, d), *_local targets only


@dataclass
class PromptTruth:
    """One prompt as computed (float64), before it is cast to the storage dtype."""

    id: str
    text: str
    token_ids: list[int]
    jacobian: np.ndarray  # (d, n, d)
    embeddings: np.ndarray  # (n, d)
    output: np.ndarray  # (d,)
    bias: np.ndarray | None  # (d,)
    next_token_id: int
    layerwise: dict[str, LayerwiseTruth] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def synthetic_model(d_model: int = 8, vocab: int = 40, *, seed: int = 0, final_norm: bool = True,
                    tokenizer: bool = True) -> SyntheticModel:
    """Random embedding and unembedding (vocab, d_model), a positive final norm gain, and words for the ids."""
    if vocab < len(WORDS) + 1:
        raise ValueError(f"Expected vocab >= {len(WORDS) + 1} (the synthetic words). Got {vocab}.")
    rng = np.random.default_rng([seed, 1])
    words = (UNK, *WORDS, *(f"w{i}" for i in range(vocab - len(WORDS) - 1)))
    gain = rng.uniform(0.5, 2.0, d_model) if final_norm else None
    return SyntheticModel(rng.standard_normal((vocab, d_model)), rng.standard_normal((vocab, d_model)), gain, words,
                          tokenizer)


def factory_rank(keep: str) -> int | None:
    """``full`` -> None, ``rank:K`` -> K (parsed by :meth:`detjac.store.Keep.parse`); the factory writes no
    ``--keep none`` (lens) prompts."""
    try:
        parsed = Keep.parse(keep)
    except ValueError:
        parsed = Keep(jacobian=False)
    if not parsed.jacobian:
        raise ValueError(f"Expected keep 'full' or 'rank:K'. Got {keep!r}.")
    return parsed.rank


def run_description(model: SyntheticModel, *, n_layers: int, dtype: str = "float64", keep: str = "full",
                    detach: bool = True, row_block: int = 3, targets: Sequence[str] = (), mode: str = "reverse",
                    affine: bool = False, model_id: str = "synthetic") -> dict[str, Any]:
    """The run description a real run writes (``runs/batch.py:run_description``, ``runs/plan.py:prepare_run``)."""
    config = {"d_model": model.d_model, "vocab": len(model.words), "n_layers": n_layers, "affine": affine,
              "embedding": hashlib.sha256(model.embedding.tobytes()).hexdigest()}
    run = {"model_id": model_id, "model_path": f"/synthetic/{model_id}", "revision": None, "model_type": "synthetic",
           "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
           "dtype": dtype, "keep": keep, "detach": detach, "position": -1, "target": "hidden", "family": "synthetic",
           "detach_rules": ["norm: rsqrt frozen", "mlp: act(gate) frozen", "attention: softmax frozen"]
           if detach else [], "convention": None, "lens": None, "graph": None, "row_block": row_block,
           "max_tokens": 256,
           "detjac_version": __version__}
    weights = {"model.safetensors": hashlib.sha256(model.embedding.tobytes() + model.unembedding.tobytes()).hexdigest()}
    tokenizer = {"tokenizer.json": hashlib.sha256(" ".join(model.words).encode()).hexdigest()}
    run.update({"weights": weights,  # as runs/fingerprint.py:weights_identity describes a checkpoint's files
                "weights_sha256": hashlib.sha256(json.dumps(weights, sort_keys=True).encode()).hexdigest(),
                "tokenizer": tokenizer,
                "tokenizer_sha256": hashlib.sha256(json.dumps(tokenizer, sort_keys=True).encode()).hexdigest()})
    if targets:  # the layer-streamed engine wrote it
        run.update({"engine": "streamed", "layerwise": list(targets), "quantize": None, "mode": mode,
                    "max_memory": None})
    return run


def _random_jacobian(rng: np.random.Generator, d: int, n: int) -> np.ndarray:
    return rng.standard_normal((d, n, d)) / np.sqrt(d)  # (d, n, d)


def _through(jacobian: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    return np.einsum("rtc,tc->r", jacobian, inputs)


def _local(rng: np.random.Generator, output: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    """A random (d, n, d) Jacobian corrected on the last token so that it maps ``inputs`` to ``output``."""
    d, n = output.shape[0], inputs.shape[0]
    J = _random_jacobian(rng, d, n)
    last = inputs[-1]
    J[:, -1, :] += np.outer(output - _through(J, inputs), last) / (last @ last)
    return J


def _layers(rng: np.random.Generator, x: np.ndarray, n_layers: int) -> dict[str, LayerwiseTruth]:
    """Every target of every layer (see the module docstring), with respect to the embeddings ``x`` (n, d)."""
    n, d = x.shape
    identity = np.zeros((d, n, d))
    identity[:, -1, :] = np.eye(d)
    out: dict[str, LayerwiseTruth] = {}
    cumulative = identity  # layer.(L-1), starting from layer.(-1)
    for layer in range(n_layers):
        inputs = rng.standard_normal((n, d))  # the hidden states entering the layer; the last one is known
        inputs[-1] = _through(cumulative, x)
        attn, mlp = 0.5 * _random_jacobian(rng, d, n), 0.5 * _random_jacobian(rng, d, n)
        cumulative = cumulative + attn + mlp
        parts = {}
        for component, J in (("attn", attn), ("mlp", mlp)):
            y = _through(J, x)
            out[f"{component}.{layer}"] = LayerwiseTruth(J, y, None)
            parts[component] = _local(rng, y, inputs)
            out[f"{component}_local.{layer}"] = LayerwiseTruth(parts[component], y, inputs)
        out[f"layer.{layer}"] = LayerwiseTruth(cumulative, _through(cumulative, x), None)
        local = identity + parts["attn"] + parts["mlp"]
        out[f"layer_local.{layer}"] = LayerwiseTruth(local, _through(local, inputs), inputs)
    return out


def synthetic_prompt(model: SyntheticModel, run: dict[str, Any], text: str, *, n_layers: int,
                     targets: Sequence[str] = (), affine: bool = False, seed: int = 0) -> PromptTruth:
    """One prompt's exact arrays (see the module docstring); ``targets`` picks the layerwise ones kept."""
    rng = np.random.default_rng([seed, int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)])
    ids = model.tokenize(text)
    if not ids:
        raise ValueError(f"Expected a prompt of at least one word. Got {text!r}.")
    x = model.embedding[ids]  # (n, d)
    layers = _layers(rng, x, n_layers)
    h = layers[f"layer.{n_layers - 1}"].output
    gain = model.final_norm if model.final_norm is not None else np.ones(model.d_model)
    scale = gain / np.sqrt(np.mean(h**2) + EPS)  # the final norm, its rsqrt frozen
    J = scale[:, None, None] * layers[f"layer.{n_layers - 1}"].jacobian
    y = _through(J, x)
    bias = rng.standard_normal(model.d_model) if affine else None
    if bias is not None:
        y = y + bias
    if not run["detach"]:  # the ordinary Jacobian: same output, a map that does not reconstruct it
        J = J + 0.3 * _random_jacobian(rng, model.d_model, len(ids))
    next_id = int(np.argmax(model.unembedding @ y))
    for name in targets:  # to_output.L: dy/dh_L at every position, exact on random states h_L (last: layer.L's)
        t = Target.parse(name)
        if t.is_to_output:
            states = rng.standard_normal((len(ids), model.d_model))
            states[-1] = layers[f"layer.{t.layer}"].output
            layers[name] = LayerwiseTruth(_local(rng, y, states), y, states)
    kept = {t: layers[t] for t in targets}
    return PromptTruth(prompt_id(run, text), text, ids, J, x, y, bias, next_id, kept)


def prompt_texts(count: int, n_tokens: int, *, seed: int = 0) -> list[str]:
    """``count`` different prompts of ``n_tokens`` words of :data:`WORDS`."""
    rng = np.random.default_rng([seed, 2])
    texts: list[str] = []
    while len(texts) < count:
        text = " ".join(rng.choice(WORDS, n_tokens))
        if text not in texts:
            texts.append(text)
    return texts


def layer_targets(n_layers: int, components: str = "layer,attn,mlp") -> list[str]:
    """Every layer's targets of ``components`` (``--layers all --components ...``), in target order."""
    from ...targets import layer_targets as grammar

    return [t.name for t in grammar("all", components, n_layers)]
