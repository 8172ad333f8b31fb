"""Which engine: a loaded model wrapped as it is, or a checkpoint loaded into the engine the user's options ask for."""

from __future__ import annotations

from typing import Any

from detjac.errors import InvalidArgumentError
from detjac.model_settings import LoadSpec

from .checkpoints.loading import load_model
from .checkpoints.reference import ModelRef
from .inmemory.inmemory_engine import InMemoryEngine
from .interface import Engine
from .streamed.streamed_engine import StreamedEngine


def as_engine(model: Any, *, detach: bool = True, tokenizer: Any | None = None,
              forward: str = "transpose") -> Engine:
    """``model`` if it is an engine already, else a loaded transformers model wrapped in the in-memory engine."""
    if isinstance(model, Engine):
        return model
    return InMemoryEngine(model, detach=detach, tokenizer=tokenizer, forward=forward)


def load_engine(source: Any, *, streamed: bool = False, dtype: Any = None, device: str = "cpu",
                detach: bool = True, max_memory: str | dict[str, int] | None = None, quantize: str | None = None,
                revision: str | None = None, trust_remote_code: bool = False, convention: str | None = None) -> Engine:
    """Load a model into an engine: the layer-streamed one when ``streamed`` (or a memory budget, or quantizing on
    load, which only it does: :func:`detjac.model_settings.wants_streamed`), else the in-memory one.

    Parameters
    ----------
    source
        What to load: a :class:`~detjac.model_settings.LoadSpec` (then it says everything and the other arguments
        are not read), or the model as the CLI's MODEL takes it: ``"default"`` (the shipped model), a GGUF file
        (``*.gguf``, its weights dequantized to ``dtype``), a checkpoint folder, a Hugging Face hub id ``org/name``
        (from the cache, or downloaded), or a :class:`~detjac.engine.ModelRef` already resolved. A string is resolved
        here, once (with ``revision``).
    dtype
        Compute dtype, a torch dtype or its name (``"float64"``, ``"float32"``, ``"bfloat16"``); default float64,
        the exactness mode.
    max_memory
        Budgets per device (``"cuda:0=8GiB,cpu=32GiB"``); the streamed engine sizes its blocks to them.
    convention
        The family's detach convention (None: its default); refused with the valid ones when it has no such.

    Returns
    -------
    Engine
        ``print(engine)`` names the model, its family, dtype, device and whether it is streamed.

    Raises
    ------
    CheckpointError
        ``source`` names nothing loadable (the message says what was expected).
    InvalidArgumentError
        A dtype, budget or convention that is not one, or a spec that names no model.
    """
    if isinstance(source, LoadSpec):
        return _load(source)
    spec = LoadSpec(model=ModelRef.of(source, revision), dtype="float64" if dtype is None else dtype,  # type: ignore[arg-type]
                    device=device, streamed=streamed, max_memory=max_memory,  # type: ignore[arg-type]
                    quantize=quantize, detach=detach, convention=convention, trust_remote_code=trust_remote_code)
    return _load(spec)


def _load(spec: LoadSpec) -> Engine:
    """``spec.model`` loaded into the engine ``spec`` asks for, in its dtype (a torch dtype or its name: the loaders
    read it, :func:`detjac.engine.memory.compute_dtype`)."""
    ref = spec.model
    if not isinstance(ref, ModelRef):
        raise InvalidArgumentError(f"Expected a load spec naming a resolved model (a ModelRef). Got model={ref!r}.")
    if spec.streamed_engine:
        return StreamedEngine(ref, dtype=spec.dtype, device=spec.device, detach=spec.detach,
                              max_memory=spec.max_memory, quantize=spec.quantize, revision=ref.revision,
                              trust_remote_code=spec.trust_remote_code, convention=spec.convention)
    model = load_model(ref, dtype=spec.dtype, device=spec.device, revision=ref.revision,
                       trust_remote_code=spec.trust_remote_code)
    engine = InMemoryEngine(model, detach=spec.detach, convention=spec.convention)
    engine.model_ref = ref  # what print(engine) names
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

    from detjac.targets import TO_OUTPUT, Target, kinds, parse_components

    from .checkpoints.loading import read_checkpoint
    from .families import family_for

    names = parse_components(components)
    _, raw = read_checkpoint(ModelRef.of(source))
    family = family_for(SimpleNamespace(model_type=raw.get("model_type")))
    needs_output = [c for c in names if Target(0, c.removesuffix("_local")).base == TO_OUTPUT
                    or Target(0, c.removesuffix("_local")).normed]
    if family.encoder and needs_output:
        valid = [k for k in kinds() if not Target(0, k.removesuffix("_local")).normed and k != TO_OUTPUT]
        raise InvalidArgumentError(
            f"Expected --components among {', '.join(valid)} for an encoder ({family.name}): it has no final norm, "
            f"so the output y that {', '.join(needs_output)} are defined by does not exist. Got {components!r}."
        )
