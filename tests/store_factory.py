"""Synthetic stores for the store and analysis tests: no torch, no model, exact by construction.

:func:`make_store` writes a complete store through ``detjac.store``'s public API only
(``create_store``, ``begin``, ``write_rows`` / ``write_block`` / ``write_array`` /
``write_layerwise`` / ``write_triplets``, ``commit``), with the same arrays and attributes a
real ``detjac run`` writes (``runs/batch.py``, ``runs/plan.py``): the run description, the
model's ``embedding``, ``unembedding`` and ``final_norm`` and a ``tokenizer.json`` under
``model/``, and per prompt its Jacobian (or its low-rank triplets), embeddings, output, token
ids, an affine model's bias, and layerwise Jacobians.

The numbers come from a small random "model" that is exactly linear at each prompt, so
everything a store promises holds to rounding:

- the input embeddings are rows of the embedding matrix, ``x_k = E[token_k]``;
- layer ``L`` adds an attention and an MLP Jacobian (random) to the residual stream:
  ``layer.L = layer.(L-1) + attn.L + mlp.L``, with ``layer.(-1)`` the identity on the last
  token (docs/store-format.md), each target's ``output`` being ``sum_k J_k x_k``;
- the output is the final norm with its scale frozen: ``y = g * r * h`` for ``h`` the last
  layer's output, so ``J = diag(g r) layer.(n_layers-1)``, plus an offset ``b`` for an
  affine model; the next token is ``argmax(W_U y)``;
- a ``*_local.L`` target multiplies the hidden states entering layer ``L`` (``inputs``,
  the last of which is ``layer.(L-1)``'s output) and reconstructs the same output as its
  cumulative twin; ``layer_local.L = identity + attn_local.L + mlp_local.L``;
- a ``to_output.L`` target maps random layer states ``h_L`` (``input``, the last one ``layer.L``'s
  output) to the output ``y`` exactly: a random Jacobian corrected on the last token;
- an ordinary (``detach=False``) run's Jacobian is perturbed, so it does not reconstruct,
  and stores the error it has.

The truth (every array, in float64 before storage) is returned with the store, so tests
compare what the store and the analyses give back with independent numpy computations.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from detjac import __version__
from detjac.exactness import relative_error
from detjac.store import JacobianStore, Keep, LayerwiseSpec, create_store, open_store, prompt_id
from detjac.store.subspace import SubspaceIteration
from detjac.targets import Target

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


@dataclass
class SyntheticStore:
    """A store written by :func:`make_store` and what it was written from."""

    path: Path
    run: dict[str, Any]
    model: SyntheticModel
    prompts: dict[str, PromptTruth]  # by prompt id, in the order written

    def open(self) -> JacobianStore:
        return open_store(self.path)

    @property
    def ids(self) -> list[str]:
        return sorted(self.prompts)


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


def storage_dtype(dtype: str) -> str:
    """As ``runs/batch.py``: 16-bit results are stored as float32."""
    return "float32" if dtype in ("bfloat16", "float16") else dtype


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


def write_prompt(store: JacobianStore, model: SyntheticModel, run: dict[str, Any], truth: PromptTruth, *,
                 line: int = 1, token_block: int = 1, graph: dict[str, Any] | None = None) -> float:
    """Write one prompt as a real run does (``runs/batch.py:write_prompt``); returns its stored reconstruction error.

    Every Jacobian goes in blocks (``write_block``): row blocks in reverse mode, ``token_block``
    tokens at a time in forward mode (the run's ``mode``, for runs with layerwise targets);
    ``keep`` of ``rank:K`` stores triplets from the store's subspace iteration instead; ``graph`` (a graph JSON
    object) is kept as the prompt's attribution graph, as a ``--graph`` run keeps it.
    """
    storage = storage_dtype(run["dtype"])
    rank = factory_rank(run["keep"])
    row_block, d, n = run["row_block"], model.d_model, truth.n_tokens
    J, x, y = (a.astype(storage) for a in (truth.jacobian, truth.embeddings, truth.output))
    bias = truth.bias.astype(storage) if truth.bias is not None else None
    error = _error(J, x, y, bias)
    mode = run.get("mode", "reverse")
    specs = {name: _spec(name, mode, token_block) for name in truth.layerwise}
    extra: dict[str, Any] = {}
    with store.begin(truth.id, n_rows=d, n_tokens=n, n_cols=d, dtype=storage, row_block=row_block, rank=rank,
                     layerwise=specs or None, graph=graph is not None) as writer:
        if graph is not None:
            writer.write_graph(graph)
        if rank is not None:
            extra = _write_low_rank(writer, J, rank, row_block, run.get("passes", LOW_RANK_PASSES))
        else:
            _write_blocks(writer, "jacobian", J, mode if specs else "reverse", row_block, token_block)
        if specs:  # the streamed engine: every target block by block, and what its blocks were
            extra = _write_layerwise(writer, truth, specs, storage, row_block, token_block, x)
            extra["stream"] = {"row_block": row_block, "token_block": token_block, "bytes_read": 0}
        writer.write_array("embeddings", x)
        writer.write_array("output", y)
        writer.write_array("token_ids", np.asarray(truth.token_ids, dtype=np.int64))
        if bias is not None:
            writer.write_array("bias", bias)
            extra["affine"] = True
        writer.commit({**_prompt_attrs(model, run, truth, line, error, storage), **extra})
    return error


def _spec(name: str, mode: str, token_block: int) -> LayerwiseSpec:
    t = Target.parse(name)
    return LayerwiseSpec(t.layer, t.component, t.local, mode, token_block)


def _error(J: np.ndarray, x: np.ndarray, y: np.ndarray, bias: np.ndarray | None = None) -> float:
    """The reconstruction error of the stored values, as ``detjac store verify`` recomputes it."""
    recon = _through(J.astype(np.float64), x.astype(np.float64))
    if bias is not None:
        recon += bias.astype(np.float64)
    return relative_error(recon, y.astype(np.float64))


def _write_blocks(writer: Any, target: str, J: np.ndarray, mode: str, row_block: int, token_block: int) -> None:
    d, n = J.shape[:2]
    if mode == "forward":  # token blocks of every row
        for k in range(0, n, token_block):
            writer.write_block(target, 0, d, k, min(k + token_block, n), J[:, k:k + token_block])
    else:
        for start in range(0, d, row_block):
            stop = min(start + row_block, d)
            writer.write_block(target, start, stop, 0, n, J[start:stop])


def _write_layerwise(writer: Any, truth: PromptTruth, specs: dict[str, LayerwiseSpec], storage: str,
                     row_block: int, token_block: int, x: np.ndarray) -> dict[str, Any]:
    layerwise = {}
    for name, spec in specs.items():
        t = truth.layerwise[name]
        J, y = t.jacobian.astype(storage), t.output.astype(storage)
        _write_blocks(writer, name, J, spec.mode, row_block, token_block)
        writer.write_layerwise(name, "output", y)
        inputs = x
        if t.inputs is not None:
            inputs = t.inputs.astype(storage)
            writer.write_layerwise(name, Target.parse(name).source_array or "inputs", inputs)
        layerwise[name] = {"reconstruction_error": _error(J, inputs, y), "mode": spec.mode}
    return {"layerwise": layerwise}


def _write_low_rank(writer: Any, J: np.ndarray, rank: int, row_block: int, passes: int) -> dict[str, Any]:
    d, n, cols = J.shape
    iteration = SubspaceIteration(d, n, cols, rank, passes=passes)
    more = True
    while more:
        for start in range(0, d, row_block):
            stop = min(start + row_block, d)
            iteration.update(start, stop, J[start:stop].astype(np.float64))
        more = iteration.end_pass()
    return {**writer.write_triplets(*iteration.finish()), "passes": passes}


def _prompt_attrs(model: SyntheticModel, run: dict[str, Any], truth: PromptTruth, line: int, error: float,
                  storage: str) -> dict[str, Any]:
    """As ``runs/batch.py:_prompt_attrs``."""
    from detjac.store.format import now

    words = model.words
    return {"prompt": truth.text, "line": line, "meta": {}, "n_tokens": truth.n_tokens, "token_ids": truth.token_ids,
            "tokens": [words[i] for i in truth.token_ids], "reconstruction_error": error,
            "next_token_id": truth.next_token_id, "next_token": words[truth.next_token_id],
            "detached": run["detach"], "dtype": run["dtype"], "storage_dtype": storage, "model_id": run["model_id"],
            "revision": run["revision"], "model_type": run["model_type"], "position": run["position"],
            "detach_rules": run["detach_rules"], "detjac_version": __version__, "written_at": now()}


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
    from detjac.targets import layer_targets as grammar

    return [t.name for t in grammar("all", components, n_layers)]


def make_store(path: str | Path, *, prompts: int | Sequence[str] = 2, d_model: int = 8, n_tokens: int = 4,
               vocab: int = 40, n_layers: int = 2, targets: Sequence[str] = (), keep: str = "full",
               affine: bool = False, detach: bool = True, dtype: str = "float64", row_block: int = 3,
               mode: str = "reverse", token_block: int = 1, final_norm: bool = True, tokenizer: bool = True,
               seed: int = 0, model: SyntheticModel | None = None,
               graphs: Callable[[PromptTruth], dict[str, Any]] | None = None) -> SyntheticStore:
    """Create a store at ``path`` and write ``prompts`` (a count, or texts of words) into it; see the module docstring.

    ``targets`` names layerwise Jacobians (``layer.1``, ``mlp_local.0``, ...; negative layers count
    from the end) stored with every prompt; ``keep="rank:K"`` stores triplets (no layerwise
    targets); ``affine`` adds an offset ``b``; ``detach=False`` writes an ordinary run's
    Jacobians. ``model`` reuses another store's model (two runs of the same model). ``graphs`` gives each prompt's
    attribution graph (e.g. :func:`synthetic_graph`), stored with it as a ``--graph`` run stores it.
    """
    model = model or synthetic_model(d_model, vocab, seed=seed, final_norm=final_norm, tokenizer=tokenizer)
    names = [Target.parse(t, n_layers).name for t in targets]
    rank = factory_rank(keep)
    if names and (rank is not None or affine):
        raise ValueError("Expected layerwise targets in full mode of a linear model (as the streamed engine). "
                         f"Got keep={keep!r}, affine={affine}.")
    texts = prompt_texts(prompts, n_tokens, seed=seed) if isinstance(prompts, int) else list(prompts)
    run = run_description(model, n_layers=n_layers, dtype=dtype, keep=keep, detach=detach, row_block=row_block,
                          targets=names, mode=mode, affine=affine)
    truths: dict[str, PromptTruth] = {}
    with create_store(path, run, model_data=lambda: model.model_data(storage_dtype(dtype))) as store:
        for line, text in enumerate(texts, start=1):
            truth = synthetic_prompt(model, run, text, n_layers=n_layers, targets=names, affine=affine, seed=seed)
            if truth.id not in truths:
                write_prompt(store, model, run, truth, line=line, token_block=token_block,
                             graph=graphs(truth) if graphs is not None else None)
                truths[truth.id] = truth
    return SyntheticStore(Path(path), run, model, truths)


def synthetic_graph(truth: PromptTruth, neurons: Sequence[tuple[int, int, int]], *, n_layers: int = 2,
                    seed: int = 0) -> dict[str, Any]:
    """A graph JSON object of the shape ``detjac.engine.graph_dict`` makes (circuit-tracer's schema_version 1) for
    ``truth``'s tokens: the ``neurons`` given as (layer, index, position), every token, and two logits; links from
    every token to every neuron and from every neuron to the first logit, with random weights."""
    rng = np.random.default_rng([seed, len(neurons)])
    n, logit_layer, pos = truth.n_tokens, n_layers + 1, truth.n_tokens - 1
    nodes: list[dict[str, Any]] = []
    for layer, index, p in neurons:
        nodes.append({"node_id": f"{layer}_{index}_{p}", "feature": (layer + index) * (layer + index + 1) // 2 + index,
                      "layer": str(layer), "ctx_idx": p, "feature_type": "mlp neuron", "jsNodeId": f"{layer}_{index}-0",
                      "clerp": f"writes 'n{layer}.{index}'", "influence": float(rng.uniform()),
                      "activation": float(rng.standard_normal())})
    for p, token in enumerate(truth.token_ids):
        nodes.append({"node_id": f"E_{token}_{p}", "feature": p, "layer": "E", "ctx_idx": p,
                      "feature_type": "embedding", "jsNodeId": f"E_{token}-{p}", "clerp": WORDS[token]
                      if token < len(WORDS) else str(token), "influence": float(rng.uniform())})
    for k, token in enumerate((truth.next_token_id, (truth.next_token_id + 1) % 40)):
        nodes.append({"node_id": f"{logit_layer}_{token}_{pos}", "feature": token, "layer": str(logit_layer),
                      "ctx_idx": pos, "feature_type": "logit", "token_prob": 0.6 - 0.3 * k, "is_target_logit": k == 0,
                      "jsNodeId": f"L_{token}-{pos}", "clerp": f'Output "w{token}" (p={0.6 - 0.3 * k:.3f})',
                      "influence": float(rng.uniform()), "activation": float(rng.standard_normal())})
    neuron_ids = [node["node_id"] for node in nodes[:len(neurons)]]
    token_ids = [node["node_id"] for node in nodes[len(neurons):len(neurons) + n]]
    target = nodes[len(neurons) + n]["node_id"]
    links = [{"source": t, "target": m, "weight": float(rng.standard_normal())} for m in neuron_ids for t in token_ids]
    links += [{"source": m, "target": target, "weight": float(rng.standard_normal())} for m in neuron_ids]
    metadata = {"slug": truth.id, "scan": "synthetic", "transcoder_list": [], "prompt_tokens": [str(t) for t in
                truth.token_ids], "prompt": truth.text, "node_threshold": 0.8, "schema_version": 1,
                "info": {"generator": "detjac", "exact": True, "error_nodes": 0, "edge_threshold": 0.98}}
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": qparams, "nodes": nodes, "links": links}
