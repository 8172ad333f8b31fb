"""``detjac neurons``: a neuron index of a corpus, every MLP neuron's top contexts, histogram and logit effects.

The corpus (read as ``detjac run`` reads it) is cut into shards of ``shard_prompts`` prompts, in file order. A shard
is computed in this process or by a dask.distributed worker (each loads the model once), as
:class:`~detjac.store.NeuronStats` of its prompts; the shards' statistics are merged in this process (exactly: the
same top-K whatever the order, see :mod:`detjac.store.neuron_stats`) and the index is committed after each shard,
listing the shards it counts, so a killed run resumes where its last commit ends. The last commit adds each neuron's
write vector through the unembedding and the corpus tokens' texts, and marks the index complete."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from detjac.errors import InvalidArgumentError
from detjac.model_settings import LoadSpec
from detjac.outputs import STORE, check_output

from .plan import load_for
from .prompts import PromptsFile, check_tokenized, read_prompts, tokenize_each
from .scheduler import ClusterOptions

if TYPE_CHECKING:
    from detjac.engine import Engine, ModelRef
    from detjac.store import NeuronStats

TOP_K = 20
SHARD_PROMPTS = 32
BATCH = 16  # prompts per forward pass (where the engine batches)
WRITE_TOKENS = 10  # tokens kept of each write vector's logit effects, each way
Log = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class NeuronOptions:
    """``detjac neurons``'s options: ``top_k`` contexts kept per neuron and sign; ``shard_prompts`` prompts per
    shard (one commit each); ``force_new`` replaces an index made otherwise; how the model loads (``load``, a
    :class:`~detjac.model_settings.LoadSpec`) and where the shards are computed (``cluster``, a
    :class:`~detjac.runs.scheduler.ClusterOptions`) as every model-loading command and ``detjac run``."""

    load: LoadSpec = field(default_factory=LoadSpec)
    cluster: ClusterOptions = field(default_factory=ClusterOptions)
    top_k: int = TOP_K
    shard_prompts: int = SHARD_PROMPTS
    max_tokens: int | None = None
    force_new: bool = False

    def check(self) -> None:
        """Refuse, before anything is read or written, a K or shard size below 1 or both cluster options."""
        for name in ("top_k", "shard_prompts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"Expected {name.replace('_', ' ')} to be a positive integer (at least 1). "
                                           f"Got {value!r}. Nothing was written.")
        self.cluster.check()


@dataclass
class NeuronOutcome:
    path: Path
    prompts: int
    tokens: int
    computed_tokens: int
    seconds: float
    resumed_shards: int
    shape: tuple[int, int]


def model_digest(engine: Engine, model: ModelRef) -> dict[str, Any]:
    """What names the model in an index's identity (and in a graph that asks for one): its weights' SHA-256 and
    family, or, for a model without files (a test's in-memory model), its parameter count."""
    from .fingerprint import model_identity

    ident = model_identity(model.source) if getattr(model, "source", None) is not None else {}
    return {"weights_sha256": ident.get("weights_sha256"), "family": engine.family.name,
            "model_type": engine.config.model_type, "n_layers": engine.n_layers}


def bos_token(engine: Engine) -> int | None:
    """The tokenizer's beginning-of-sequence token id (None without one)."""
    bos = getattr(engine.tokenizer, "bos_token_id", None)
    return bos if isinstance(bos, int) else None


def shard_stats(engine: Engine, prompts: list[tuple[int, list[int]]], k: int, n_neurons: int,
                step: Callable[[int], None] | None = None) -> NeuronStats:
    """The statistics of ``prompts`` ((index in the corpus, token ids) each) on ``engine``, a leading BOS token
    left out (the same context in every prompt: it would tie for the top of every neuron); in batches of
    :data:`BATCH` prompts through one forward pass where the engine allows it
    (:func:`detjac.engine.neuron_values`), else one trace per prompt."""
    from detjac.engine import neuron_values
    from detjac.store import NeuronStats

    stats = NeuronStats.empty(engine.n_layers, n_neurons, k)
    bos = bos_token(engine)
    for b0 in range(0, len(prompts), BATCH):
        batch = prompts[b0:b0 + BATCH]
        values = neuron_values(engine, [ids for _, ids in batch])
        keep = [np.arange(len(ids)) >= (1 if bos is not None and ids and ids[0] == bos else 0) for _, ids in batch]
        rows = np.concatenate([np.full(int(k.sum()), p, dtype=np.int64) for (p, _), k in zip(batch, keep, strict=True)])
        positions = np.concatenate([np.nonzero(k)[0] for k in keep])
        for layer in range(engine.n_layers):
            stats.add_rows(layer, rows, positions,
                           np.concatenate([v[layer][k] for v, k in zip(values, keep, strict=True)]))
        n = int(rows.size)
        stats.n_tokens += n
        if step is not None:
            step(n)
    return stats


def build_neuron_index(model: str | ModelRef, prompts: str | Path | PromptsFile, out: str | Path,
                       options: NeuronOptions, log: Log | None = None, progress: bool = True) -> NeuronOutcome:
    """Build (or resume) the neuron index of ``model`` on ``prompts`` at ``out`` (see the module docstring).

    Raises
    ------
    InvalidArgumentError
        K or a shard size below 1 (before anything is read).
    PromptsFileError, PromptError
        An empty corpus, a line that is not text, a prompt the tokenizer refuses or longer than ``max_tokens``:
        before anything is written.
    NeuronIndexMismatch
        An index at ``out`` made with another model or settings (``force_new`` replaces it).
    """
    from detjac.engine import ModelRef
    from detjac.store import writing_index

    options.check()
    reads = [] if isinstance(prompts, PromptsFile) else [("the corpus", prompts)]
    check_output(out, kind=STORE, reads=reads)  # Python callers get the command's rules: never into a store or index
    corpus = prompts if isinstance(prompts, PromptsFile) else read_prompts(prompts)
    spec = replace(options.load, model=ModelRef.of(model))  # a string is the API's: resolved here, once
    ref, engine = spec.model, load_for(spec)
    max_tokens = options.max_tokens or engine.context
    tokenized = tokenize_each(corpus, engine.prompt_model(), engine.tokenizer, max_tokens)
    check_tokenized(corpus, tokenized, max_tokens)
    ids = [t.ids for t in tokenized]
    probe = max(ids, key=len)  # the write vectors are read on its trace (a mixture of experts: routed to most)
    n_neurons = _neurons_per_layer(engine, probe)  # refuses an engine without neurons before a file is written
    identity = {**model_digest(engine, ref), "dtype": spec.dtype, "convention": spec.convention,
                "k": options.top_k, "shard_prompts": options.shard_prompts, "corpus_sha256": corpus.digest(),
                "prompts": len(ids), "neurons_per_layer": n_neurons}
    out = Path(out)
    with writing_index(out):  # held to the end: another run on this index is refused, --force-new included
        return _build(out, engine, spec, ids, corpus, identity, options, probe, log, progress)


def _build(out: Path, engine: Engine, spec: LoadSpec, ids: list[list[int]], corpus: PromptsFile,
           identity: dict[str, Any], options: NeuronOptions, probe: list[int], log: Log | None,
           progress: bool) -> NeuronOutcome:
    """Start (or resume) the index at ``out``, compute and commit its pending shards, then its last commit."""
    import time

    from detjac.store import commit_index, start_index

    n_neurons = identity["neurons_per_layer"]
    done = set(start_index(out, identity, options.force_new))
    size = options.shard_prompts
    shards = [list(range(s, min(s + size, len(ids)))) for s in range(0, len(ids), size)]
    state, already = _resume(out, engine.n_layers, n_neurons, options.top_k, done)
    corpus_arrays = _corpus_arrays(corpus, ids)
    pending = [i for i in range(len(shards)) if i not in done]
    if log is not None:
        log(f"{len(ids)} prompts ({sum(map(len, ids))} tokens) in {len(shards)} shards; {len(done)} already in {out}; "
            f"{len(pending)} to compute.")
    start = time.perf_counter()
    computed = 0

    def commit(shard: int, stats: NeuronStats) -> None:
        nonlocal computed
        state.merge(stats)
        computed += stats.n_tokens
        done.add(shard)
        commit_index(out, identity, state, corpus_arrays, sorted(done))

    with _TokenBar(sum(len(ids[p]) for s in pending for p in shards[s]), progress) as bar:
        work = [(s, [(p, ids[p]) for p in shards[s]]) for s in pending]
        if options.cluster.distributed:
            for shard, stats in _on_cluster(spec, work, options, n_neurons, log):
                bar.update(stats.n_tokens)
                commit(shard, stats)
        else:
            for shard, items in work:
                commit(shard, shard_stats(engine, items, options.top_k, n_neurons, bar.update))
    seconds = time.perf_counter() - start
    _finish(out, engine, identity, state, corpus_arrays, probe, sorted(done))
    return NeuronOutcome(out, len(ids), state.n_tokens, computed, seconds, already, (engine.n_layers, n_neurons))


def _neurons_per_layer(engine: Engine, probe: list[int]) -> int:
    from detjac.engine import neuron_values

    for z in neuron_values(engine, [probe])[0].values():
        return int(z.shape[1])
    raise InvalidArgumentError("Expected a model with at least one MLP layer. Got none.")


def _resume(out: Path, n_layers: int, n_neurons: int, k: int, done: set[int]) -> tuple[NeuronStats, int]:
    """The statistics the index's last commit holds (empty for a new index), and how many shards it counts."""
    from detjac.store import NeuronStats, index_state

    if not done:
        return NeuronStats.empty(n_layers, n_neurons, k), 0
    return index_state(out), len(done)


def _corpus_arrays(corpus: PromptsFile, ids: list[list[int]]) -> dict[str, np.ndarray]:
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in ids])]).astype(np.int64)
    flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in ids])
    return {"prompt_tokens": flat, "prompt_offsets": offsets,
            "prompt_line": np.asarray([item.line for item in corpus.prompts], dtype=np.int64)}


def _finish(out: Path, engine: Engine, identity: dict[str, Any], state: NeuronStats,
            corpus_arrays: dict[str, np.ndarray], probe: list[int], shards: list[int]) -> None:
    """The last commit: write effects, the texts of every token the index names, ``complete``."""
    from detjac.engine import write_effects
    from detjac.store import commit_index
    from detjac.tokens import token_labels

    write_ids, write_values = write_effects(engine, probe, WRITE_TOKENS)
    vocab = np.unique(np.concatenate([corpus_arrays["prompt_tokens"], write_ids[write_ids >= 0].ravel()]))
    texts = [t.encode("utf-8", "surrogatepass") for t in token_labels(engine.tokenizer, vocab.tolist())]
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in texts])]).astype(np.int64)
    utf8 = np.frombuffer(b"".join(texts), dtype=np.uint8)
    commit_index(out, identity, state,
                 {**corpus_arrays, "vocab_ids": vocab, "vocab_utf8": utf8, "vocab_offsets": offsets}, shards,
                 {"write_ids": write_ids, "write_values": write_values})


class _TokenBar:
    """A bar counting tokens, with the rate in tokens/s (the plain bar of a log file says it too)."""

    def __init__(self, total: int, progress: bool) -> None:
        import time

        from detjac.progress import tqdm

        self.bar, self.start, self.clock = tqdm(total=total, desc="tokens", unit="tok", disable=not progress), \
            time.perf_counter(), time.perf_counter
        self.n = 0

    def update(self, n: int) -> None:
        self.n += n
        seconds = self.clock() - self.start
        self.bar.set_postfix(rate=f"{self.n / seconds:.1f} tok/s" if seconds > 0 else "-")
        self.bar.update(n)

    def __enter__(self) -> _TokenBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


def _on_cluster(spec: LoadSpec, work: list[tuple[int, list[tuple[int, list[int]]]]], options: NeuronOptions,
                n_neurons: int, log: Log | None) -> Iterator[tuple[int, NeuronStats]]:
    """Each shard's statistics, computed on the workers, in the order they finish."""
    from distributed import as_completed

    from .cluster import ModelPlugin
    from .scheduler import dask_cluster

    c = options.cluster
    threads = max(1, len(os.sched_getaffinity(0)) // c.workers) if c.workers else None
    with dask_cluster(c, trim_memory=False, log=log) as client:
        plugin = ModelPlugin(spec, f"detjac-neurons-{os.getpid()}", threads, c.scheduler is None)
        client.register_plugin(plugin)
        futures = [client.submit(_shard_on_worker, plugin.name, items, options.top_k, n_neurons,
                                 key=f"detjac-neurons-shard-{shard}-{os.getpid()}", retries=2)
                   for shard, items in work]
        shard_of = {f.key: shard for f, (shard, _) in zip(futures, work, strict=True)}
        try:
            for future in as_completed(futures):
                yield shard_of[future.key], future.result()
                future.release()
        finally:
            client.cancel(futures)


def _shard_on_worker(plugin: str, items: list[tuple[int, list[int]]], k: int, n_neurons: int) -> NeuronStats:
    from distributed import get_worker

    return shard_stats(get_worker().plugins[plugin].get(), items, k, n_neurons)
