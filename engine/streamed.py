"""The layer-streamed engine: detached Jacobians of models larger than the compute device.

Once the nonlinear factors are frozen, the model is a linear map, and so is each decoder
layer. :class:`StreamedModel` keeps the model as an empty skeleton (parameters on the
``meta`` device) and materializes one decoder layer at a time, from a loaded model or
straight from the checkpoint's safetensors shards, releasing it as soon as the layer is
done. Peak memory is one layer's weights, the prompt's hidden states, and one block of
cotangent (or tangent) vectors.

1. **Forward pass** (:meth:`StreamedModel.trace`): layer by layer, keeping each layer's
   input hidden states (n_tokens, d_model) and the residual between its attention and
   MLP blocks. The frozen factors (norm scales, attention probabilities, gate
   activations) are recomputed from a layer's input when the layer is streamed in again:
   one n-token forward, small next to a block of vectors.
2. **Reverse mode** (row blocks): a block of cotangent rows of every requested target
   goes from the top layer down, through ``torch.func.vjp`` of one detached layer at a
   time, vmapped over the block. Targets deeper in the model join the block as the sweep
   reaches their layer, so one sweep serves them all and each layer's weights are read
   once per block. Where a layer's cotangents are zero before some position (the top layer:
   they sit at the target position only; below a sliding window, a band), the layer is pulled
   back from the outputs of the later positions only: its attention reads the values of every
   position as functions of the input (:class:`~detjac.engine.detach.AttentionReplay`, live),
   so the pullback runs the value projection over all positions and the output projection
   and the MLP over the suffix (one position at the top).
3. **Forward mode** (column blocks): tangents of whole tokens' input columns go from the
   bottom layer up through ``torch.func.jvp``; every layer's cumulative Jacobian (its
   output, attention and MLP contributions w.r.t. the input embeddings) is read off on the
   way, in one sweep per column block.

Cost model (units: one vector of n_tokens positions through one layer). Reverse mode
costs ``d_model * sum(depth(t))`` over the requested targets (depth: layers between the
target and the input), less nearly one layer per target at the top of a sweep (there only
the value projection runs over every position); forward mode costs ``n_tokens * d_model * max(depth(t))`` without
truncation. The layers are causal, so the tangents of tokens ``k0:k1`` are zero before
position ``k0``: forward mode carries them over positions ``k0:`` only (the attention
reads the prefix's values and probability rows recorded by one full-length forward of
the layer, :class:`~detjac.engine.detach.AttentionReplay`), which brings its cost to
``sum over blocks (k1 - k0) * d_model * (n_tokens - k0) / n_tokens`` per layer, about
half for small blocks.
``mode="auto"`` takes forward mode for the cumulative targets when it is cheaper (many
layers, short prompt) and reverse mode otherwise; per-layer (``*_local``) targets are
always reverse mode (one layer each).

Memory budgets (``max_memory="cuda:0=8GiB,cpu=32GiB"``): the block is sized so that one
layer (twice, while the next is read), the trace and the block's vectors fit the compute
device's budget. On CPU a budget also makes glibc return large freed blocks to the system
at once (:func:`return_freed_memory`, process-wide): with its default adaptive threshold
the sweeps' short-lived cotangent buffers fragment the heap and the resident set grows to
several times what is in use. The price is page faults on every new buffer (measured
1.0-1.45x the time of a sweep on 2 CPU cores with 4 KiB pages), so without a budget the
default allocator is kept. Page faults are why the ``detjac`` command sets PyTorch's
``THP_MEM_ALLOC_ENABLE=1`` before torch loads (buffers of 2 MiB and more on transparent huge
pages: 20x fewer faults in a 128-token row block); from Python, export it before importing torch.

Targets (:class:`Target`): ``output`` is the final normed hidden state (what
:func:`detjac.engine.detached_jacobian` returns). ``layer.L`` is decoder layer L's output
(the residual stream after it), ``attn.L`` and ``mlp.L`` are its attention and MLP blocks'
contributions to the residual stream (post-norms included: ``layer.L = layer.L-1 +
attn.L + mlp.L``), all at the target position and w.r.t. the input embeddings. The
``*_local.L`` variants are w.r.t. layer L's own input. Each reconstructs its own target
value exactly: ``sum_k J[:, k, :] x_k`` with ``x`` the input embeddings (cumulative) or
the layer's input hidden states (local).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from detjac.errors import InvalidArgumentError, UnsupportedModelError

from .decode import final_norm_gain
from .detach import AttentionReplay
from .families import family_for
from .linearize import linearized
from .loading import _read_checkpoint, parse_prompt
from .weights import ModuleWeights, WeightSource, open_source

COMPONENTS = ("layer", "attn", "mlp")
LOCAL_SUFFIX = "_local"
DEFAULT_ROW_BLOCK = 64
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True, order=True)
class Target:
    """One Jacobian the engine can compute; see the module docstring for the meanings."""

    layer: int  # -1 for the model output
    component: str  # "output", "layer", "attn" or "mlp"
    local: bool = False

    @property
    def name(self) -> str:
        if self.component == "output":
            return "output"
        return f"{self.component}{LOCAL_SUFFIX if self.local else ''}.{self.layer}"

    @classmethod
    def parse(cls, name: str, n_layers: int) -> Target:
        """``output``, ``layer.3``, ``attn.3``, ``mlp_local.3``, ... (negative layers count from the end)."""
        if name == "output":
            return cls(-1, "output")
        m = re.fullmatch(r"(layer|attn|mlp)(_local)?\.(-?\d+)", name)
        if m is None:
            raise InvalidArgumentError(
                f"Expected a target 'output' or COMPONENT[_local].LAYER with COMPONENT one of "
                f"{', '.join(COMPONENTS)} (e.g. 'attn.3'). Got {name!r}."
            )
        return cls(_layer_index(int(m.group(3)), n_layers), m.group(1), bool(m.group(2)))

    def depth(self, n_layers: int) -> float:
        """Layers between the target and the vectors' seed, for the cost model."""
        if self.local:
            return 1.0
        if self.component == "output":
            return float(n_layers)
        return self.layer + (0.5 if self.component == "attn" else 1.0)


def _layer_index(i: int, n_layers: int) -> int:
    if not -n_layers <= i < n_layers:
        raise InvalidArgumentError(f"Expected a layer index in [-{n_layers}, {n_layers}). Got {i}.")
    return i % n_layers


def layer_targets(layers: str | Sequence[int], components: str | Sequence[str], n_layers: int) -> list[Target]:
    """Targets for ``--layers all|0,5,10`` and ``--components layer,attn,mlp[,*_local]``."""
    if isinstance(layers, str):
        text = layers.strip().lower()
        if text == "all":
            picked = list(range(n_layers))
        else:
            try:
                picked = [int(p) for p in text.split(",") if p.strip()]
            except ValueError:
                raise InvalidArgumentError(
                    f"Expected --layers 'all' or comma-separated layer indices (e.g. 0,5,10). Got {layers!r}."
                ) from None
    else:
        picked = list(layers)
    names = [c.strip() for c in components.split(",")] if isinstance(components, str) else list(components)
    allowed = [*COMPONENTS, *(c + LOCAL_SUFFIX for c in COMPONENTS)]
    bad = [c for c in names if c not in allowed]
    if bad or not names or not picked:
        raise InvalidArgumentError(
            f"Expected at least one layer and components among {', '.join(allowed)}. "
            f"Got layers {layers!r} and components {components!r}."
        )
    out = {Target(_layer_index(i, n_layers), c.removesuffix(LOCAL_SUFFIX), c.endswith(LOCAL_SUFFIX))
           for i in picked for c in names}
    return sorted(out)


def parse_memory(text: str | None) -> dict[str, int]:
    """``"cuda:0=8GiB,cpu=32GiB"`` -> ``{"cuda:0": 8 * 2**30, "cpu": 32 * 2**30}``."""
    if text is None or not text.strip():
        return {}
    budgets: dict[str, int] = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*([a-z]+(?::\d+)?)\s*=\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", part, flags=re.IGNORECASE)
        if m is None:
            raise InvalidArgumentError(
                f"Expected --max-memory as DEVICE=SIZE[,DEVICE=SIZE] (e.g. cuda:0=8GiB,cpu=32GiB). Got {text!r}."
            )
        device = _device_key(m.group(1))
        if device in budgets:
            raise InvalidArgumentError(f"Expected each device once in --max-memory. Got {device} twice in {text!r}.")
        budgets[device] = int(float(m.group(2)) * _UNITS[(m.group(3) or "").upper()])
    return budgets


def _device_key(device: str | torch.device) -> str:
    """``"cuda"`` -> ``"cuda:0"`` (as accelerate reads it), ``"CPU"`` -> ``"cpu"``."""
    try:
        d = torch.device(str(device).strip().lower())
    except RuntimeError:
        raise InvalidArgumentError(f"Expected a torch device such as cpu, cuda or cuda:1. Got {device!r}.") from None
    return "cpu" if d.type == "cpu" else f"{d.type}:{d.index or 0}"


@dataclass
class Trace:
    """The forward pass of one prompt: what the sweeps need and what the targets must equal."""

    token_ids: list[int]
    position: int
    embeddings: torch.Tensor  # (n, d)
    inputs: list[torch.Tensor]  # inputs[l]: layer l's input (n, d); inputs[L]: the last layer's output
    mids: list[torch.Tensor]  # mids[l]: residual between layer l's attention and MLP blocks (n, d)
    output: torch.Tensor  # (d,) final normed hidden state at position
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(repr=False, default_factory=list)

    def value(self, t: Target) -> torch.Tensor:
        """The target's value at the position (what its Jacobian must reconstruct)."""
        p = self.position
        if t.component == "output":
            return self.output
        if t.component == "layer":
            return self.inputs[t.layer + 1][p]
        if t.component == "attn":
            return self.mids[t.layer][p] - self.inputs[t.layer][p]
        return self.inputs[t.layer + 1][p] - self.mids[t.layer][p]

    def source(self, t: Target) -> torch.Tensor:
        """(n, d): the vectors the target's Jacobian acts on."""
        return self.inputs[t.layer] if t.local else self.embeddings


@dataclass(frozen=True)
class JacobianBlock:
    """Rows ``start:stop`` and tokens ``token_start:token_stop`` of one target's Jacobian."""

    target: Target
    start: int
    stop: int
    token_start: int
    token_stop: int
    values: torch.Tensor  # (stop - start, token_stop - token_start, d_model)


@dataclass
class Plan:
    """How one request is computed: which targets go which way, in blocks of what size."""

    reverse: list[Target]
    forward: list[Target]
    row_block: int
    token_block: int
    reverse_cost: float
    forward_cost: float
    n_row_blocks: int
    n_token_blocks: int

    @property
    def n_blocks(self) -> int:
        return self.n_row_blocks + self.n_token_blocks


@dataclass
class StreamStats:
    """Memory accounting of a :class:`StreamedModel` (checked by the tests)."""

    layers_loaded: int = 0
    max_resident_layers: int = 0
    resident: set[int] = field(default_factory=set)
    bytes_read: int = 0
    suffix_layers: int = 0  # forward-mode layer sweeps run on a suffix of the positions (causal truncation)
    pulled_suffix_layers: int = 0  # reverse-mode layer pullbacks from the outputs of a suffix of the positions


class StreamedModel:
    """A causal LM whose decoder layers are materialized one at a time.

    Parameters
    ----------
    source
        A checkpoint folder with safetensors shards (weights are read layer by layer and
        never all held), or a loaded model (its tensors are used in place; with another
        ``device`` or ``dtype`` one layer at a time is copied).
    dtype
        Compute dtype; float64 is the exactness mode.
    device
        Where layers are computed (``cpu``, ``cuda``, ``cuda:1``).
    detach
        Freeze the nonlinear factors (detached Jacobian) or not (ordinary Jacobian).
    max_memory
        Budgets per device, e.g. ``{"cuda:0": 8 * 2**30, "cpu": 32 * 2**30}`` or the
        ``--max-memory`` text: the row block is then chosen to fit the compute device's.
    quantize
        ``nf4``, ``fp4`` or ``int8``: run the model bitsandbytes would run after
        quantizing a float checkpoint on load (each linear weight goes through bnb's
        quantize-dequantize round trip as its layer is streamed in).
    """

    def __init__(self, source: str | Path | nn.Module, *, dtype: torch.dtype = torch.float64,
                 device: str | torch.device = "cpu", detach: bool = True,
                 max_memory: dict[str, int] | str | None = None, quantize: str | None = None,
                 revision: str | None = None, trust_remote_code: bool = False,
                 tokenizer: Any | None = None) -> None:
        self.dtype, self.device, self.detach = dtype, torch.device(device), detach
        if isinstance(max_memory, str) or max_memory is None:
            self.budgets = parse_memory(max_memory)
        else:
            self.budgets = {_device_key(k): int(v) for k, v in max_memory.items()}
        if self.budgets and _device_key(self.device) not in self.budgets:
            raise InvalidArgumentError(
                f"Expected a memory budget for the compute device {_device_key(self.device)}. "
                f"Got budgets for {', '.join(self.budgets)} only."
            )
        if self.device.type == "cpu" and "cpu" in self.budgets:
            return_freed_memory()
        if isinstance(source, nn.Module):
            config, cls, raw = source.config, type(source), None
            self.path: Path | None = None
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            self.path, raw = _read_checkpoint(source)
            config = AutoConfig.from_pretrained(self.path, revision=revision, trust_remote_code=trust_remote_code)
            cls = AutoModelForCausalLM._model_mapping[type(config)]
        self.family = family_for(config)
        if not self.family.streamable:
            kind = "affine: biases or position embeddings" if self.family.affine else "mixture of experts"
            raise UnsupportedModelError(
                f"Expected a model the layer-streamed engine supports (bias-free, dense, causal). Got a "
                f"{self.family.name} model ({kind}{', encoder' if self.family.encoder else ''}), which it would "
                "not linearize correctly. "
                "Use the in-memory engine (detjac run without --streamed, --layers or --max-memory)."
            )
        self.config = config
        self.source: WeightSource = open_source(source, raw)
        if quantize is not None:
            from .quant import QUANT_METHODS

            if quantize not in QUANT_METHODS:
                raise InvalidArgumentError(f"Expected quantize one of {', '.join(QUANT_METHODS)}. Got {quantize!r}.")
            if self.source.quantized:
                raise InvalidArgumentError(
                    f"Expected a float checkpoint to quantize on load. Got one already quantized "
                    f"({self.source.quantized})."
                )
        self.quantize = quantize
        self.tokenizer = tokenizer if tokenizer is not None else self._tokenizer(source, revision, trust_remote_code)
        self.model = self._skeleton(cls, config)
        self.stats = StreamStats()
        self._linearized = linearized(self.model, detach=detach)
        lin = self._linearized.__enter__()  # the skeleton is private: it stays linearized
        self.decoder = lin.decoder
        self.decoder_path = next(n for n, m in self.model.named_modules() if m is self.decoder)
        self.layers: nn.ModuleList = self.decoder.layers
        self.n_layers = len(self.layers)
        text = config.get_text_config()
        self.d_model = int(text.hidden_size)
        self.ffn = int(getattr(text, "intermediate_size", 4 * self.d_model))
        self._materialize(self._slots["norm"], f"{self.decoder_path}.norm.")

    # -- building -----------------------------------------------------------------------

    @staticmethod
    def _tokenizer(source: Any, revision: str | None, trust_remote_code: bool) -> Any | None:
        if isinstance(source, nn.Module):
            from .loading import get_tokenizer

            return get_tokenizer(source)
        path = Path(source).expanduser()
        if not any(path.glob("tokenizer*")):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)

    def _skeleton(self, cls: type, config: Any) -> nn.Module:
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
        self._slots: dict[Any, dict[str, tuple[nn.Module, str]]] = {
            i: _param_slots(layer) for i, layer in enumerate(decoder.layers)
        }
        self._slots["norm"] = _param_slots(decoder.norm)
        return model

    # -- weights ------------------------------------------------------------------------

    def _read(self, prefix: str, slots: dict[str, tuple[nn.Module, str]]) -> dict[str, torch.Tensor]:
        """The tensors of one subtree in the compute dtype and on the compute device."""
        if self.source.quantized:
            from .quant import dequantize_layer

            first = next(iter(slots))
            key = self.source.resolve(prefix + first)
            stored_prefix = key[: len(key) - len(first)]
            raw = {k[len(stored_prefix):]: self.source.read(k) for k in self.source.names()
                   if k.startswith(stored_prefix)}
            self.stats.bytes_read += sum(t.numel() * t.element_size() for t in raw.values())
            plain = dequantize_layer(raw, self.dtype)
        else:
            plain = {}
            for rel in slots:
                t = self.source.read(self.source.resolve(prefix + rel))
                self.stats.bytes_read += t.numel() * t.element_size()
                plain[rel] = t
        out = {}
        for rel, (module, attr) in slots.items():
            t = plain[rel].to(device=self.device, dtype=self.dtype)
            if self.quantize is not None and attr == "weight" and isinstance(module, nn.Linear):
                from .quant import quantize_roundtrip

                t = quantize_roundtrip(t, self.quantize)
            out[rel] = t
        return out

    def _materialize(self, slots: dict[str, tuple[nn.Module, str]], prefix: str) -> None:
        for rel, t in self._read(prefix, slots).items():
            module, attr = slots[rel]
            module._parameters[attr] = nn.Parameter(t, requires_grad=False)

    @staticmethod
    def _release(slots: dict[str, tuple[nn.Module, str]]) -> None:
        for module, attr in slots.values():
            p = module._parameters[attr]
            module._parameters[attr] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                    requires_grad=False)

    def load_layer(self, i: int) -> None:
        """Materialize decoder layer ``i`` on the compute device."""
        self._materialize(self._slots[i], f"{self.decoder_path}.layers.{i}.")
        self.stats.layers_loaded += 1
        self.stats.resident.add(i)
        self.stats.max_resident_layers = max(self.stats.max_resident_layers, len(self.stats.resident))

    def release_layer(self, i: int) -> None:
        """Put layer ``i``'s parameters back on the meta device (their memory is freed)."""
        self._release(self._slots[i])
        self.stats.resident.discard(i)

    def layer_bytes(self) -> int:
        """Bytes of the largest decoder layer in the compute dtype."""
        return max(sum(m._parameters[a].numel() for m, a in s.values()) for k, s in self._slots.items()
                   if k != "norm") * self.dtype.itemsize

    def _layer(self, i: int) -> _Loaded:
        return _Loaded(self, i)

    # -- the forward pass ---------------------------------------------------------------

    def embed(self, ids: Sequence[int]) -> torch.Tensor:
        """(n, d) input embeddings of ``ids``, reading only those rows of the embedding matrix."""
        emb = self.decoder.get_input_embeddings()
        name = next(n for n, m in self.model.named_modules() if m is emb) + ".weight"
        unique = sorted(set(ids))
        rows = self.source.read_rows(self.source.resolve(name), unique).to(device=self.device, dtype=self.dtype)
        index = {t: j for j, t in enumerate(unique)}
        x = rows[torch.tensor([index[i] for i in ids], device=self.device)]
        scale = getattr(emb, "embed_scale", None)  # Gemma3 scales inside its embedding module
        return x * scale.to(self.dtype) if scale is not None else x

    def _record_calls(self, x: torch.Tensor) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """The arguments the decoder passes each layer (masks, position tables), without running any layer."""
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

        def record(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            calls.append((args, kwargs))
            return hidden

        patched = [*self.layers, self.decoder.norm]
        for module in patched:
            module.forward = record if module is not self.decoder.norm else (lambda h: h)
        try:
            with torch.no_grad():
                self.decoder(inputs_embeds=x[None], use_cache=False)
        finally:
            for module in patched:
                del module.forward
        return calls

    def _step(self, i: int, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
              ) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """Layer ``i`` as a function (n, d) -> (output (n, d), mid residual (n, d))."""
        return self._layer_fn(i, *calls[i])

    def _layer_fn(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        layer = self.layers[i]
        mid_module = getattr(layer, self.family.mid_residual)

        def step(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            seen: list[torch.Tensor] = []
            handle = mid_module.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
            try:
                out = layer(h[None], *args, **kwargs)
            finally:
                handle.remove()
            out = out[0] if isinstance(out, tuple) else out
            # squeeze, not [0]: its pullback is a view, where indexing's writes into a zeroed buffer per vector
            return out.squeeze(0), seen[0].squeeze(0)

        return step

    def _suffix_fn(self, i: int, calls: list[tuple[tuple[Any, ...], dict[str, Any]]], n: int,
                   start: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        """Layer ``i`` on positions ``start:``, to run under an :class:`AttentionReplay`'s ``replay``; None where
        running a suffix would not be exact: not detaching, or arguments it cannot slice."""
        args, kwargs = calls[i]
        sliced = _suffix_kwargs(kwargs, start, n)
        if not self.detach or args or sliced is None:
            return None
        return self._layer_fn(i, args, sliced)

    def _suffix_step(self, i: int, calls: list[tuple[tuple[Any, ...], dict[str, Any]]], h: torch.Tensor,
                     start: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        """Layer ``i`` on positions ``start:`` only, (n - start, d) -> (n - start, d) twice, for tangents that
        are zero before ``start``; None where that would not be exact (see :meth:`_suffix_fn`), or where the
        layer is not causal (checked on the recorded probabilities).

        One full-length forward of the layer records the attention's values and frozen probabilities;
        the suffix then runs with the prefix's values (constants) and its own probability rows. Exact
        because the layer is causal and every other factor is position-wise.
        """
        step = self._suffix_fn(i, calls, h.shape[0], start)
        if step is None:
            return None
        replay = AttentionReplay()
        with replay.record(), torch.no_grad():
            self._step(i, calls)(h)
        if not replay.records or not replay.causal():
            return None
        self.stats.suffix_layers += 1

        def suffix(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with replay.replay(start):
                return step(hs)

        return suffix

    def _pulled_suffix_step(self, i: int, calls: list[tuple[tuple[Any, ...], dict[str, Any]]], h: torch.Tensor,
                            start: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        """Layer ``i`` as a function of all its input positions, (n, d) -> the outputs of positions ``start:``,
        (n - start, d) twice, for cotangents that are zero before ``start``; None where a suffix cannot run
        (see :meth:`_suffix_fn`).

        The function runs the layer at full length once, keeping the attention's values as functions of
        the input, then the suffix with them: the pullback goes through the value projections of every
        position but through the output projection and the MLP of the suffix only (the full run's other
        outputs are not used, so nothing is pulled back through them). A layer whose recorded
        probabilities are not causal gives the full run's outputs at ``start:`` instead (exact too).
        """
        step = self._suffix_fn(i, calls, h.shape[0], start)
        if step is None:
            return None
        full = self._step(i, calls)

        def pulled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            replay = AttentionReplay()
            with replay.record(live=True):
                out, mid = full(x)
            if not replay.records or not replay.causal():
                return out[start:], mid[start:]
            self.stats.pulled_suffix_layers += 1
            with replay.replay(start):
                return step(x[start:])

        return pulled

    def _final(self, position: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda h: self.decoder.norm(h)[position]

    def trace(self, prompt: str | Sequence[int] | torch.Tensor, *, position: int = -1,
              progress: bool = False) -> Trace:
        """Run the forward pass layer by layer; keep each layer's input and mid residual."""
        ids = parse_prompt(prompt, self.prompt_model(), self.tokenizer)
        if not -len(ids) <= position < len(ids):
            raise InvalidArgumentError(f"Expected a position in [-{len(ids)}, {len(ids)}). Got {position} instead.")
        x = self.embed(ids)
        calls = self._record_calls(x)
        inputs, mids, h = [x], [], x
        for i in _bar(range(self.n_layers), progress, "forward pass", "layer", leave=False):
            with self._layer(i), torch.no_grad():
                h, mid = self._step(i, calls)(h)
            inputs.append(h)
            mids.append(mid)
        with torch.no_grad():
            output = self._final(position)(h)
        return Trace(ids, position % len(ids), x, inputs, mids, output, calls)

    def prompt_model(self) -> Any:
        """An object with what :func:`parse_prompt` reads (vocab size, context length, config)."""
        emb = self.decoder.get_input_embeddings()
        return _PromptModel(self.config, int(emb.num_embeddings))

    # -- logits -------------------------------------------------------------------------

    def _matrix_key(self, which: str) -> str:
        """The checkpoint key of the input embedding (``"embedding"``) or unembedding matrix."""
        head = self.model.get_output_embeddings()
        tied = getattr(self.config.get_text_config(), "tie_word_embeddings", False) or \
            getattr(self.config, "tie_word_embeddings", False)
        module = self.decoder.get_input_embeddings() if which == "embedding" or tied else head
        name = next(n for n, m in self.model.named_modules() if m is module) + ".weight"
        return self.source.resolve(name)

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

    def logits(self, hidden: torch.Tensor, *, chunk: int = 16384) -> torch.Tensor:
        """Next-token logits (..., vocab) from final normed hidden states, reading W_U in row chunks."""
        key = self._matrix_key("unembedding")
        vocab = self.model.get_output_embeddings().weight.shape[0]
        parts = []
        for start in range(0, vocab, chunk):
            rows = self.source.read_range(key, start, min(start + chunk, vocab))
            parts.append(hidden.to(self.dtype) @ rows.to(device=hidden.device, dtype=self.dtype).T)
        logits = torch.cat(parts, dim=-1)
        cap = getattr(self.config.get_text_config(), "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # -- planning -----------------------------------------------------------------------

    def plan(self, trace: Trace, targets: Sequence[Target], *, mode: str = "auto",
             row_block: int | None = None, token_block: int | None = None) -> Plan:
        """Split ``targets`` between reverse and forward mode and size the blocks (see the module docstring)."""
        if mode not in ("auto", "reverse", "forward"):
            raise InvalidArgumentError(f"Expected mode auto, reverse or forward. Got {mode!r}.")
        for name, value in (("row_block", row_block), ("token_block", token_block)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidArgumentError(f"Expected {name} to be a positive integer. Got {value!r} instead.")
        n, d, L = len(trace.token_ids), self.d_model, self.n_layers
        cumulative = [t for t in targets if not t.local]
        budget = self._vector_budget(trace)
        rows_fit = budget // self._vector_bytes(n) if budget is not None else None
        if token_block is None:
            token_block = max(1, n // 4) if rows_fit is None else min(n, rows_fit // d)
        reverse_cost = d * sum(t.depth(L) for t in cumulative)
        forward_cost = self._forward_vectors(n, max(1, token_block)) * max((t.depth(L) for t in cumulative),
                                                                           default=0.0)
        forward_ok = mode == "forward" or (mode == "auto" and forward_cost < reverse_cost
                                           and (rows_fit is None or rows_fit >= d))
        fwd = sorted(cumulative) if forward_ok and cumulative else []
        rev = sorted(t for t in targets if t not in fwd)
        n_rev = max(1, len(rev))
        if row_block is None:
            row_block = DEFAULT_ROW_BLOCK if rows_fit is None else min(d, rows_fit // n_rev)
            if row_block >= 1:  # as few blocks as fit, evened out (no short last block)
                row_block = -(-d // -(-d // row_block))
        if budget is not None and ((rev and row_block < 1) or (fwd and token_block < 1)):
            raise InvalidArgumentError(
                f"Expected a memory budget that holds one layer ({self.layer_bytes() / 2**30:.2f} GiB) and at least "
                f"{n_rev if rev else d} vectors of {self._vector_bytes(n) / 2**20:.1f} MiB. Got "
                f"{self._device_budget() / 2**30:.2f} GiB for {self.device}: raise --max-memory."
            )
        row_block, token_block = max(1, row_block), max(1, token_block)
        return Plan(rev, fwd, row_block, token_block, reverse_cost, forward_cost,
                    -(-d // row_block) if rev else 0, -(-n // token_block) if fwd else 0)

    def _forward_vectors(self, n: int, token_block: int) -> float:
        """Forward mode's vectors per layer, in units of n positions: a block of tokens ``k0:k1`` carries
        ``(k1 - k0) * d`` tangents over positions ``k0:`` only (causal truncation, detached models)."""
        if not self.detach:
            return float(n * self.d_model)
        return sum(min(token_block, n - k0) * self.d_model * (n - k0) / n for k0 in range(0, n, token_block))

    def _device_budget(self) -> int | None:
        return self.budgets.get(_device_key(self.device))

    def _vector_bytes(self, n: int) -> int:
        """Bytes one vector of the block costs inside one layer's vjp/jvp (measured: see benchmarks/)."""
        return self.dtype.itemsize * n * (8 * self.d_model + 4 * self.ffn)

    def _vector_budget(self, trace: Trace) -> int | None:
        """Bytes left for the block: the budget less one layer (twice while it is read) and the trace."""
        budget = self._device_budget()
        if budget is None:
            return None
        n = len(trace.token_ids)
        trace_bytes = (2 * self.n_layers + 2) * n * self.d_model * self.dtype.itemsize
        return max(0, budget - 2 * self.layer_bytes() - trace_bytes)

    # -- the sweeps ---------------------------------------------------------------------

    def blocks(self, trace: Trace, targets: Sequence[Target], plan: Plan | None = None, *,
               progress: bool = False) -> Iterator[JacobianBlock]:
        """Every requested Jacobian, block by block (reverse mode first, then forward mode)."""
        plan = plan if plan is not None else self.plan(trace, targets)
        d, n = self.d_model, len(trace.token_ids)
        bar = _bar(None, progress, "blocks", "block", total=plan.n_blocks)
        try:
            for start in range(0, d, plan.row_block) if plan.reverse else ():
                yield from self._reverse(trace, plan.reverse, start, min(start + plan.row_block, d), progress)
                if bar is not None:
                    bar.update()
            for k0 in range(0, n, plan.token_block) if plan.forward else ():
                yield from self._forward(trace, plan.forward, k0, min(k0 + plan.token_block, n), progress)
                if bar is not None:
                    bar.update()
        finally:
            if bar is not None:
                bar.close()

    def _reverse(self, trace: Trace, targets: list[Target], r0: int, r1: int,
                 progress: bool, seed: torch.Tensor | None = None) -> Iterator[JacobianBlock]:
        """Rows ``r0:r1`` of every target; with ``seed`` (r1 - r0, n, d), its rows at the target position are
        pulled back instead of the basis rows ``r0:r1``: the values are then ``seed[:, p] @ J`` (matrix-free)."""
        n, d, p, L = len(trace.token_ids), self.d_model, trace.position, self.n_layers
        dev, dt = self.device, self.dtype
        if seed is None:
            seed = torch.zeros(r1 - r0, n, d, dtype=dt, device=dev)
            seed[torch.arange(r1 - r0), p, torch.arange(r0, r1)] = 1.0
        active: list[tuple[Target, torch.Tensor]] = []  # cotangents at the current layer's output
        if any(t.component == "output" for t in targets):
            _, pull = torch.func.vjp(self._final(p), trace.inputs[L].to(dev))
            with torch.no_grad():
                active.append((Target(-1, "output"), torch.func.vmap(pull)(seed[:, p])[0]))
        top = max((L - 1 if t.component == "output" else t.layer) for t in targets)
        dense = False  # once the cotangents reach position 0 they stay there (the residual path passes them on)
        for i in _bar(range(top, -1, -1), progress, "reverse sweep", "layer", leave=False):
            # (target, cotangent at the layer's output, at its mid residual); None: zero
            entries: list[tuple[Target, torch.Tensor | None, torch.Tensor | None]] = [(t, g, None) for t, g in active]
            for t in (t for t in targets if t.layer == i and t.component != "output"):
                if t.component == "layer":
                    entries.append((t, seed, None))
                elif t.component == "attn":
                    entries.append((t, None, seed))
                else:
                    entries.append((t, seed, -seed))
            if not entries:
                continue
            g_out = _stacked([e[1] for e in entries], seed)
            g_mid = _stacked([e[2] for e in entries], seed) if any(e[2] is not None for e in entries) else None
            del entries[:]  # the concatenated copies are all that is kept
            with self._layer(i):
                h = trace.inputs[i].to(dev)
                s = 0 if dense else _first_nonzero_position(*(g for g in (g_out, g_mid) if g is not None))
                step = self._pulled_suffix_step(i, trace.calls, h, s) if 0 < s < n else None
                if step is None:
                    step, s = self._step(i, trace.calls), 0
                dense = s == 0
                if g_mid is None:  # only the output's cotangents: the mid residual is not pulled back
                    _, pull = torch.func.vjp(lambda x, step=step: step(x)[0], h)
                    cotangents: Any = g_out[:, s:]
                else:
                    _, pull = torch.func.vjp(step, h)
                    cotangents = (g_out[:, s:], g_mid[:, s:])
                with torch.no_grad():
                    g_in = torch.func.vmap(pull)(cotangents)[0]
            del g_out, g_mid
            order = [t for t, _ in active] + [t for t in targets if t.layer == i and t.component != "output"]
            active = []
            for j, t in enumerate(order):
                g = g_in[j * (r1 - r0):(j + 1) * (r1 - r0)]
                if t.component == "attn" and t.layer == i:
                    g = g - seed  # attn = mid - input: the identity path leaves
                if t.local and t.layer == i:
                    yield JacobianBlock(t, r0, r1, 0, n, g)
                else:
                    active.append((t, g))
        for t, g in active:
            yield JacobianBlock(t, r0, r1, 0, n, g)

    def _forward(self, trace: Trace, targets: list[Target], k0: int, k1: int,
                 progress: bool, tangent: torch.Tensor | None = None) -> Iterator[JacobianBlock]:
        """Columns of tokens ``k0:k1`` of every target; with ``tangent`` (c, n, d), those directions are pushed
        instead of the basis columns, and each block's values are the products ``J @ tangent`` (d, c)."""
        n, d, p, L = len(trace.token_ids), self.d_model, trace.position, self.n_layers
        basis = tangent is None
        if tangent is None:
            c = (k1 - k0) * d
            s = k0  # causal truncation: the basis tangents are zero before position s, which they do not carry
            tangent = torch.zeros(c, n - s, d, dtype=self.dtype, device=self.device)
            cols = torch.arange(c)
            tangent[cols, k0 - s + cols // d, cols % d] = 1.0
        else:  # arbitrary directions over every position
            c, s = tangent.shape[0], 0
        top = max((L - 1 if t.component == "output" else t.layer) for t in targets)

        def columns(t: Target, v: torch.Tensor) -> JacobianBlock:  # v: (c, d) -> (d, k1 - k0, d), or (d, c)
            return JacobianBlock(t, 0, d, k0, k1, v.T.reshape(d, k1 - k0, d) if basis else v.T)

        def at(v: torch.Tensor) -> torch.Tensor:  # (c, n - s, d) -> (c, d) at the target position
            return v[:, p - s] if p >= s else v.new_zeros(c, d)

        for i in _bar(range(top + 1), progress, "forward sweep", "layer", leave=False):
            with self._layer(i), torch.no_grad():
                h = trace.inputs[i].to(self.device)
                step = self._suffix_step(i, trace.calls, h, s) if s > 0 else None
                if step is None:
                    if s > 0:  # not truncatable exactly: carry the zeros again
                        tangent = torch.cat([tangent.new_zeros(c, s, d), tangent], dim=1)
                        s = 0
                    step = self._step(i, trace.calls)
                hs = h[s:]
                t_out, t_mid = torch.func.vmap(lambda v, step=step, hs=hs: torch.func.jvp(step, (hs,), (v,))[1])(
                    tangent)
            for t in (t for t in targets if t.layer == i):
                if t.component == "layer":
                    yield columns(t, at(t_out))
                elif t.component == "attn":
                    yield columns(t, at(t_mid) - at(tangent))
                else:
                    yield columns(t, at(t_out) - at(t_mid))
            tangent = t_out
            del t_mid
        if any(t.component == "output" for t in targets):
            h = trace.inputs[L][s:].to(self.device)
            with torch.no_grad():
                y = torch.func.vmap(lambda v: torch.func.jvp(self._final(p - s), (h,), (v,))[1])(tangent) \
                    if p >= s else tangent.new_zeros(c, d)
            yield columns(Target(-1, "output"), y)

    # -- conveniences -------------------------------------------------------------------

    def jacobians(self, prompt: str | Sequence[int] | torch.Tensor, targets: Sequence[Target | str] = ("output",),
                  *, mode: str = "auto", row_block: int | None = None, token_block: int | None = None,
                  position: int = -1, progress: bool = False) -> StreamedResult:
        """Assemble the requested Jacobians in memory (small models, tests); stores take :meth:`blocks`."""
        trace = self.trace(prompt, position=position, progress=progress)
        wanted = [t if isinstance(t, Target) else Target.parse(t, self.n_layers) for t in targets]
        plan = self.plan(trace, wanted, mode=mode, row_block=row_block, token_block=token_block)
        n = len(trace.token_ids)
        out = {t: torch.empty(self.d_model, n, self.d_model, dtype=self.dtype, device=self.device) for t in wanted}
        for b in self.blocks(trace, wanted, plan, progress=progress):
            out[b.target][b.start:b.stop, b.token_start:b.token_stop] = b.values
        return StreamedResult(trace, out, plan)


@dataclass
class StreamedResult:
    """Jacobians by target, with the forward pass they linearize."""

    trace: Trace
    jacobians: dict[Target, torch.Tensor]
    plan: Plan

    def __getitem__(self, name: str | Target) -> torch.Tensor:
        key = name if isinstance(name, Target) else next((t for t in self.jacobians if t.name == name), None)
        if key not in self.jacobians:
            raise KeyError(f"Expected one of {', '.join(t.name for t in self.jacobians)}. Got {name!r}.")
        return self.jacobians[key]

    def reconstruction_error(self, name: str | Target) -> float:
        """``||sum_k J[:, k, :] x_k - value|| / ||value||`` for one target."""
        from .jacobian import reconstruct, relative_error

        t = name if isinstance(name, Target) else next(t for t in self.jacobians if t.name == name)
        return relative_error(reconstruct(self.jacobians[t], self.trace.source(t)), self.trace.value(t))


class _Loaded:
    """``with model._layer(i):`` materializes layer ``i`` and releases it afterwards."""

    def __init__(self, owner: StreamedModel, i: int) -> None:
        self.owner, self.i = owner, i

    def __enter__(self) -> None:
        self.owner.load_layer(self.i)

    def __exit__(self, *exc: object) -> None:
        self.owner.release_layer(self.i)


@dataclass(frozen=True)
class _PromptModel:
    config: Any
    vocab: int

    def get_input_embeddings(self) -> Any:
        return _Vocab(self.vocab)


@dataclass(frozen=True)
class _Vocab:
    num_embeddings: int


def _stacked(parts: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """``parts`` (each like ``like`` or None for zeros) stacked along the block axis; one part is not copied."""
    if len(parts) == 1 and parts[0] is not None:
        return parts[0]
    return torch.cat([torch.zeros_like(like) if g is None else g for g in parts])


def _first_nonzero_position(*cotangents: torch.Tensor) -> int:
    """The first position (axis 1) where any of ``cotangents`` (block, n, d) is nonzero; n if none is."""
    used = torch.stack([g.ne(0).any(dim=2).any(dim=0) for g in cotangents]).any(dim=0)
    hits = used.nonzero()
    return int(hits[0]) if hits.numel() else int(used.shape[0])


def _suffix_kwargs(kwargs: dict[str, Any], start: int, n: int) -> dict[str, Any] | None:
    """A decoder layer's keyword arguments for positions ``start:`` only; None for one it does not know."""
    out: dict[str, Any] = {}
    for key, v in kwargs.items():
        if v is None or isinstance(v, bool):
            out[key] = v
        elif key == "attention_mask" and isinstance(v, torch.Tensor) and v.shape[-2:] == (n, n):
            out[key] = v[..., start:, :]
        elif key == "position_ids" and isinstance(v, torch.Tensor) and v.shape[-1] == n:
            out[key] = v[..., start:]
        elif key == "position_embeddings" and isinstance(v, tuple) and all(
                isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] == n for t in v):
            out[key] = tuple(t[:, start:] for t in v)
        else:
            return None
    return out


def _param_slots(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every parameter under ``module`` by its relative name, with the module that owns it."""
    return {f"{mn}.{pn}" if mn else pn: (m, pn) for mn, m in module.named_modules()
            for pn, p in m._parameters.items() if p is not None}


def _bar(items: Any, progress: bool, desc: str, unit: str, leave: bool = True, total: int | None = None) -> Any:
    """``items`` wrapped in a tqdm bar when ``progress`` (a bare bar when ``items`` is None)."""
    if not progress:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit=unit, leave=leave, total=total)


def return_freed_memory() -> None:
    """Make glibc hand large freed blocks back to the system at once (process-wide).

    glibc raises its mmap threshold each time a large block is freed, after which blocks of
    that size come from the heap and freed ones stay resident: the sweeps, which allocate
    and free the same large cotangent buffers for every layer, then grow the resident set
    to several times what they use (measured: 7-12 MiB per cotangent vector instead of
    under 1.5 MiB). A fixed threshold keeps a CPU budget honest. No-op off glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: blocks >= 1 MiB are mmapped, freed at once
    except OSError:
        pass
