"""Which engine: a loaded model wrapped as it is, or a checkpoint loaded into the engine the user's options ask for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from detjac.model_settings import wants_streamed

from .checkpoints.loading import load_model
from .inmemory.inmemory_engine import InMemoryEngine
from .interface import Engine
from .streamed.streamed_engine import StreamedEngine

if TYPE_CHECKING:
    from detjac.model_settings import ModelSettings


def as_engine(model: Any, *, detach: bool = True, tokenizer: Any | None = None,
              forward: str = "transpose") -> Engine:
    """``model`` if it is an engine already, else a loaded transformers model wrapped in the in-memory engine."""
    if isinstance(model, Engine):
        return model
    return InMemoryEngine(model, detach=detach, tokenizer=tokenizer, forward=forward)


def load_engine(source: Any, *, streamed: bool = False, dtype: Any = None, device: str = "cpu",
                detach: bool = True, max_memory: str | dict[str, int] | None = None, quantize: str | None = None,
                revision: str | None = None, trust_remote_code: bool = False, convention: str | None = None) -> Engine:
    """Load a checkpoint folder into an engine: the layer-streamed one when ``streamed`` (or a memory budget, or
    quantizing on load, which only it does), else the in-memory one.

    Parameters
    ----------
    source
        A checkpoint folder or a Hugging Face hub id ``org/name`` (see :func:`load_model`).
    dtype
        Compute dtype (default float64, the exactness mode).
    max_memory
        Budgets per device (``"cuda:0=8GiB,cpu=32GiB"``); the streamed engine sizes its blocks to them.
    convention
        The family's detach convention (None: its default); refused with the valid ones when it has no such.
    """
    import torch

    dtype = torch.float64 if dtype is None else dtype
    if wants_streamed(streamed, max_memory, quantize):
        return StreamedEngine(source, dtype=dtype, device=device, detach=detach, max_memory=max_memory,
                             quantize=quantize, revision=revision, trust_remote_code=trust_remote_code,
                             convention=convention)
    model = load_model(source, dtype=dtype, device=device, revision=revision, trust_remote_code=trust_remote_code)
    return InMemoryEngine(model, detach=detach, convention=convention)


def load_engine_with(source: Any, settings: ModelSettings, *, device: str | None = None) -> Engine:
    """``source`` loaded into the engine ``settings`` ask for (see :func:`load_engine`), under this process's CPU
    budget (:func:`detjac.engine.honour_cpu_budget`). ``device`` other than the settings' own loads there without the
    memory budget, which names the settings' devices (a distributed run's client plans on the CPU)."""
    import torch

    from .memory import honour_cpu_budget

    device = device or settings.device
    engine = load_engine(source, streamed=settings.streamed_engine, dtype=getattr(torch, settings.dtype),
                         device=device, detach=settings.detach,
                         max_memory=settings.max_memory if device == settings.device else None,
                         quantize=settings.quantize, revision=settings.revision,
                         trust_remote_code=settings.trust_remote_code, convention=settings.convention)
    honour_cpu_budget(engine)  # this process computes under a CPU budget: keep the resident set honest
    return engine


def check_layerwise_request(source: Any, components: str) -> None:
    """Refuse ``--components`` a checkpoint's family cannot have, from its config alone (before any weights load).

    ``to_output`` and the ``*_normed`` targets are defined by the output ``y``, the final normed hidden state at
    the target position: an encoder (BERT) has no final norm, so they are refused for it by name.

    Raises
    ------
    InvalidArgumentError
        An unknown component (the valid ones are listed), or one the family cannot have.
    """
    from types import SimpleNamespace

    from detjac.errors import InvalidArgumentError
    from detjac.targets import TO_OUTPUT, Target, kinds, parse_components

    from .checkpoints.loading import read_checkpoint
    from .families import family_for

    names = parse_components(components)
    _, raw = read_checkpoint(source)
    family = family_for(SimpleNamespace(model_type=raw.get("model_type")))
    needs_output = [c for c in names if Target(0, c.removesuffix("_local")).base == TO_OUTPUT
                    or Target(0, c.removesuffix("_local")).normed]
    if family.encoder and needs_output:
        valid = [k for k in kinds() if not Target(0, k.removesuffix("_local")).normed and k != TO_OUTPUT]
        raise InvalidArgumentError(
            f"Expected --components among {', '.join(valid)} for an encoder ({family.name}): it has no final norm, "
            f"so the output y that {', '.join(needs_output)} are defined by does not exist. Got {components!r}."
        )
