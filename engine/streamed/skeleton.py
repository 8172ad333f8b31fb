"""Weights and skeleton of the layer-streamed engine: one decoder layer in memory at a time.

:class:`Skeleton` keeps every parameter on the ``meta`` device and materializes one layer for the duration of a block;
it also reads embedding rows, the decoding matrices and the unembedding in chunks. Details: docs/engine.md, "The
skeleton and the trace"."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from detjac.errors import CheckpointError
from detjac.singular import VOCAB_CHUNK_BYTES

from ..checkpoints.stored import Stored, check_stored_dtype, stored_bytes, widen
from ..checkpoints.weights import ModuleWeights, WeightSource
from ..pieces import lazy
from ..products.decode import RowBlocks, final_norm_gain, numpy_dtype
from ..types import EngineStats
from .prefetch import LayerFeed, make_reader

Slots = dict[str, tuple[nn.Module, str]]


class Skeleton:
    """A model whose parameters live on ``meta`` but for the decoder layers being computed.

    Parameters
    ----------
    cls, config
        The transformers model class and config to build.
    family
        The model's family (which module is the decoder).
    source
        Where the weights are read from.
    dtype, device
        Compute dtype and device.
    quantize
        ``nf4``, ``fp4`` or ``int8``: each linear weight goes through bitsandbytes' quantize-dequantize
        round trip as its layer is read; None: the weights as stored.
    """

    def __init__(self, cls: type, config: Any, family: Any, source: WeightSource, *, dtype: torch.dtype,
                 device: torch.device, quantize: str | None = None) -> None:
        self.family, self.source, self.dtype, self.device, self.quantize = family, source, dtype, device, quantize
        self.config = config
        self.stats = EngineStats()
        self.model = self._build(cls, config)
        self.decoder = family.decoder(self.model)
        self.decoder_path = next(n for n, m in self.model.named_modules() if m is self.decoder)
        self.layers: nn.ModuleList = self.decoder.layers
        self.n_layers = len(self.layers)
        text = config.get_text_config()
        self.d_model = int(text.hidden_size)
        self.ffn = int(getattr(text, "intermediate_size", 4 * self.d_model))
        self.stored_dtypes = self._check_stored()
        self._stored: dict[int, dict[str, Stored]] = {}  # the resident layers' stored tensors
        self.owned: set[int] = set()  # resident layers whose widened weights are their own (see load_layer)
        # widen the layers a matrix at a time, each just before its use (the engine sets it from its cost model's
        # CostModel.per_matrix before it traces or sweeps), else whole when they are loaded
        self.per_matrix = False
        self._lazy: dict[int, list[Any]] = {}  # per resident layer loaded a matrix at a time: its hooks' handles
        self._materialize(self._slots["norm"], f"{self.decoder_path}.norm.")
        self.feed = LayerFeed(self.n_layers, make_reader(
            lambda i, into=None: self._read(self._layer_prefix(i), self._slots[i], self.device, into),
            lambda i: self._read(self._layer_prefix(i), self._slots[i], torch.device("cpu")),
            self.device, quantize, None if isinstance(source, ModuleWeights) else self._empty), self.stats)

    def _check_stored(self) -> set[torch.dtype]:
        """The stored dtypes of every tensor the engine widens (the layers, the final norm, the embedding), each
        checked to be one it converts, from the source's header alone: refused before any work."""
        names = [self.matrix_name("embedding")]
        names += [f"{self.decoder_path}.norm.{rel}" for rel in self._slots["norm"]]
        names += [self._layer_prefix(i) + rel for i in range(self.n_layers) for rel in self._slots[i]]
        dtypes = set()
        for name in names:
            try:
                key = self.source.resolve(name)
            except CheckpointError:  # not in the checkpoint: check_complete names every such tensor, next
                continue
            dtype = self.source.stored_dtype(key)
            if dtype is not None:
                check_stored_dtype(dtype, name)
                dtypes.add(dtype)
        return dtypes

    def _empty(self, i: int) -> dict[str, torch.Tensor]:
        """Uninitialized CPU buffers for layer ``i``'s stored tensors, made by the caller's thread so that the layers a
        reader thread fills are the caller's memory (freed and reused where it allocates; made by the reader, they
        were freed into its allocator arena and the process grew)."""
        out = {}
        for rel in self._slots[i]:
            buf = self.source.stored_empty(self.source.resolve(self._layer_prefix(i) + rel))
            if buf is not None:
                out[rel] = buf
        return out

    def _layer_prefix(self, i: int) -> str:
        return f"{self.decoder_path}.layers.{i}."

    def _build(self, cls: type, config: Any) -> nn.Module:
        """The model with every parameter on the meta device; buffers (rotary tables) are real."""
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            model = cls._from_config(copy.deepcopy(config), dtype=self.dtype)
        model.eval().requires_grad_(False)
        # A loaded model's own buffers (rotary tables, embedding scales) may differ in the last bits
        # from freshly built ones (built in float32, then cast): use them, so results match it exactly.
        known = set(self.source.names()) if isinstance(self.source, ModuleWeights) else set()
        for prefix, module in model.named_modules():
            for name, buf in module._buffers.items():
                full = f"{prefix}.{name}" if prefix else name
                if full in known:
                    buf = self.source.read(full)
                if buf is not None:
                    module._buffers[name] = buf.to(self.device)
        decoder = self.family.decoder(model)
        self._slots: dict[Any, Slots] = {i: _param_slots(layer) for i, layer in enumerate(decoder.layers)}
        self._slots["norm"] = _param_slots(decoder.norm)
        return model

    def _read(self, prefix: str, slots: dict[str, tuple[nn.Module, str]], device: torch.device,
              into: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, Stored], int]:
        """The tensors of one subtree in their stored form (:mod:`~detjac.engine.checkpoints.stored`) on ``device``
        (read into ``into``'s buffers where given), and the bytes read from the source (run by a reader thread: it
        changes nothing of the skeleton's). A bitsandbytes checkpoint's layer is dequantized here, to the compute
        dtype."""
        if self.source.quantized:
            from ..checkpoints.quantized import dequantize_layer

            first = next(iter(slots))
            key = self.source.resolve(prefix + first)
            stored_prefix = key[: len(key) - len(first)]
            raw = {k[len(stored_prefix):]: self.source.read(k) for k in self.source.names()
                   if k.startswith(stored_prefix)}
            nbytes = sum(t.numel() * t.element_size() for t in raw.values())
            plain = dequantize_layer(raw, self.dtype)
            return {rel: plain[rel].to(device) for rel in slots}, nbytes
        out, nbytes = {}, 0
        for rel in slots:
            t = self.source.read_stored(self.source.resolve(prefix + rel), (into or {}).get(rel))
            nbytes += stored_bytes(t)
            out[rel] = t.to(device)
        return out, nbytes

    def _widen(self, slots: Slots, stored: dict[str, Stored]) -> dict[str, torch.Tensor]:
        """A subtree's stored tensors in the compute dtype on the compute device (the quantize round trip applied to
        linear weights)."""
        return {rel: self._widen_one(module, attr, stored[rel]) for rel, (module, attr) in slots.items()}

    def _widen_one(self, module: nn.Module, attr: str, t: Stored) -> torch.Tensor:
        out = widen(t, self.dtype, self.device)
        if self.quantize is not None and attr == "weight" and isinstance(module, nn.Linear):
            from ..checkpoints.quantized import quantize_roundtrip

            out = quantize_roundtrip(out, self.quantize)
        return out

    def _load_lazily(self, i: int, stored: dict[str, Stored]) -> None:
        """Layer ``i``'s linear weights left as stored, each widened just before its use (:mod:`~detjac.engine.
        pieces.lazy`); its other tensors (norm gains) widened now."""
        handles, now = [], {}
        for rel, (module, attr) in self._slots[i].items():
            t = stored[rel]
            if not lazy.is_lazy(module, attr, t):
                now[rel] = self._widen_one(module, attr, t)
                continue
            make = partial(self._widen_one, module, attr, t)
            handles += lazy.attach(module, lazy.LazyWeight(make, tuple(t.shape), t, count=self._count))
        self._assign({rel: self._slots[i][rel] for rel in now}, now)
        self._lazy[i] = handles

    def _count(self) -> None:
        self.stats.matrices_widened += 1

    def _materialize(self, slots: dict[str, tuple[nn.Module, str]], prefix: str) -> None:
        tensors, nbytes = self._read(prefix, slots, self.device)
        self.stats.bytes_read += nbytes
        self._assign(slots, self._widen(slots, tensors))

    @staticmethod
    def _assign(slots: dict[str, tuple[nn.Module, str]], tensors: dict[str, torch.Tensor]) -> None:
        for rel, t in tensors.items():
            module, attr = slots[rel]
            module._parameters[attr] = nn.Parameter(t, requires_grad=False)

    @staticmethod
    def _release(slots: dict[str, tuple[nn.Module, str]]) -> None:
        for module, attr in slots.values():
            p = module._parameters[attr]
            module._parameters[attr] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                    requires_grad=False)

    def load_layer(self, i: int) -> None:
        """Materialize decoder layer ``i`` on the compute device: its stored tensors (read ahead, or kept from an
        earlier pass, where the :class:`~detjac.engine.streamed.prefetch.LayerFeed` has them) widened to the compute
        dtype there."""
        stored = self.feed.get(i)
        self._stored[i] = stored
        if self.per_matrix:
            self._load_lazily(i, stored)
            tensors: dict[str, torch.Tensor] = {}
        else:
            tensors = self._widen(self._slots[i], stored)
            self._assign(self._slots[i], tensors)
        # the widened tensors are the layer's own (not the stored ones, nor a loaded model's): its pieces may fold
        # norm gains into them in place instead of copying (ExplicitAdjoint); a matrix at a time, the gains are applied
        # as each is widened
        if tensors and all(_storage(t) != _storage(stored[rel]) for rel, t in tensors.items() if rel in stored):
            self.owned.add(i)
        self.stats.layers_loaded += 1
        self.stats.resident.add(i)
        self.stats.max_resident_layers = max(self.stats.max_resident_layers, len(self.stats.resident))

    def rewiden(self, i: int) -> None:
        """Layer ``i`` (resident) widened again from its stored tensors: after its pieces folded into its weights in
        place and then could not be used, the layer as stored for ``torch.func``."""
        self._assign(self._slots[i], self._widen(self._slots[i], self._stored[i]))

    def release_layer(self, i: int) -> None:
        """Put layer ``i``'s parameters back on the meta device (their memory is freed; its stored tensors are kept
        for the next pass where the feed's budget has room)."""
        self._release(self._slots[i])
        lazy.detach_all([m for m, _ in self._slots[i].values()], self._lazy.pop(i, []))
        self.owned.discard(i)
        stored = self._stored.pop(i, None)
        if stored is not None:
            self.feed.give_back(i, stored)
        self.stats.resident.discard(i)

    def layer_bytes(self) -> int:
        """Bytes of the largest decoder layer in the compute dtype."""
        return max(sum(m._parameters[a].numel() for m, a in s.values()) for k, s in self._slots.items()
                   if k != "norm") * self.dtype.itemsize

    def stored_layer_bytes(self) -> int:
        """Bytes of the largest decoder layer as stored (what is read, held in flight and kept across passes)."""
        if self.source.quantized or isinstance(self.source, ModuleWeights):
            return self.layer_bytes()
        return max(sum(self.source.stored_nbytes(self.source.resolve(self._layer_prefix(k) + rel)) for rel in s)
                   for k, s in self._slots.items() if k != "norm")

    @contextmanager
    def layer(self, i: int) -> Iterator[None]:
        """Decoder layer ``i`` materialized for the duration of the block, released afterwards."""
        self.load_layer(i)
        try:
            yield
        except BaseException:
            self.feed.abort()  # no read left running behind an error
            raise
        finally:
            self.release_layer(i)

    def embed(self, ids: Sequence[int]) -> torch.Tensor:
        """(n, d) input embeddings of ``ids``, reading only those rows of the embedding matrix."""
        unique = sorted(set(ids))
        rows = self.source.read_rows(self._matrix_key("embedding"), unique).to(device=self.device, dtype=self.dtype)
        index = {t: j for j, t in enumerate(unique)}
        x = rows[torch.tensor([index[i] for i in ids], device=self.device)]
        scale = getattr(self.decoder.get_input_embeddings(), "embed_scale", None)  # Gemma3 scales inside it
        return x * scale.to(self.dtype) if scale is not None else x

    @property
    def tied(self) -> bool:
        """Whether the unembedding is the input embedding (read from the embedding's key)."""
        return bool(getattr(self.config.get_text_config(), "tie_word_embeddings", False) or
                    getattr(self.config, "tie_word_embeddings", False))

    def matrix_name(self, which: str) -> str:
        """The model's name of the input embedding (``"embedding"``) or unembedding matrix (``lm_head.weight``)."""
        module = self._matrix_module(which)
        return next(n for n, m in self.model.named_modules() if m is module) + ".weight"

    def _matrix_module(self, which: str) -> nn.Module:
        return self.decoder.get_input_embeddings() if which == "embedding" else self.model.get_output_embeddings()

    def _matrix_key(self, which: str) -> str:
        """The checkpoint key of the input embedding (``"embedding"``) or unembedding matrix."""
        return self.source.resolve(self.matrix_name("embedding" if self.tied else which))

    def decoding_matrices(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``embedding`` (vocab, d), ``unembedding`` (vocab, d) and ``final_norm`` (d,) on CPU, read whole from the
        source (see :func:`final_norm_gain`)."""
        keys = {which: self._matrix_key(which) for which in ("embedding", "unembedding")}
        read = {key: self.source.read(key).to(dtype or self.dtype) for key in set(keys.values())}  # tied: once
        arrays = {which: read[key] for which, key in keys.items()}
        gain = final_norm_gain(self.model)
        if gain is not None:
            arrays["final_norm"] = gain.to(device="cpu", dtype=dtype or self.dtype)
        return arrays

    def decoding_rows(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """``embedding`` and ``unembedding`` as :class:`RowBlocks` over the source (each block read when asked for),
        ``final_norm`` (d,) as a numpy array; a 16-bit ``dtype`` (default: the compute dtype) widened to float32."""
        dtype = numpy_dtype(dtype or self.dtype)
        out: dict[str, Any] = {}
        for which in ("embedding", "unembedding"):
            key = self._matrix_key(which)
            shape = tuple(self._matrix_module(which).weight.shape)
            out[which] = RowBlocks(shape, dtype, lambda a, b, key=key: self.source.read_range(key, a, b))
        gain = final_norm_gain(self.model)
        if gain is not None:
            out["final_norm"] = gain.to(device="cpu", dtype=dtype).numpy()
        return out

    def logits(self, hidden: torch.Tensor, *, chunk: int | None = None) -> torch.Tensor:
        """Next-token logits (..., vocab) from final normed hidden states, reading W_U in row chunks (as stored, each
        widened to the compute dtype on ``hidden``'s device; default: :data:`~detjac.singular.VOCAB_CHUNK_BYTES` of rows
        at a time)."""
        key = self._matrix_key("unembedding")
        vocab = self.model.get_output_embeddings().weight.shape[0]
        chunk = chunk or max(1, VOCAB_CHUNK_BYTES // (self.d_model * self.dtype.itemsize))
        parts = []
        for start in range(0, vocab, chunk):
            rows = self.source.read_range(key, start, min(start + chunk, vocab))
            parts.append(hidden.to(self.dtype) @ widen(rows, self.dtype, hidden.device).T)
        logits = torch.cat(parts, dim=-1)
        cap = getattr(self.config.get_text_config(), "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def prompt_model(self) -> Any:
        """An object with what :func:`~detjac.engine.parse_prompt` reads (vocab size, context length, config)."""
        return _PromptModel(self.config, int(self.decoder.get_input_embeddings().num_embeddings))


@dataclass(frozen=True, eq=False)  # hashed by identity: a key of the remembered tokenizers
class _PromptModel:
    config: Any
    vocab: int

    def get_input_embeddings(self) -> Any:
        return _Vocab(self.vocab)


@dataclass(frozen=True)
class _Vocab:
    num_embeddings: int


def _storage(t: Any) -> int:
    """Where a tensor's (or a packed tensor's raw blocks') memory starts: the same for a tensor and its views."""
    t = getattr(t, "raw", t)
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else -1


def _param_slots(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every parameter under ``module`` by its relative name, with the module that owns it."""
    return {f"{mn}.{pn}" if mn else pn: (m, pn) for mn, m in module.named_modules()
            for pn, p in m._parameters.items() if p is not None}

