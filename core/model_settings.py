"""How a model is loaded, in one place for the engine, the runs and the CLI (torch-free).

:class:`LoadSpec` is the one description of what to load and how (the CLI builds it from ``--dtype``, ``--device``,
``--streamed``, ``--max-memory``, ...; a run's and a neuron index's options hold one); :func:`wants_streamed` decides
when the layer-streamed engine is implied; :func:`dtype_name` reads a compute dtype the one way every model source
takes it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgumentError

DTYPES = ("float64", "float32", "bfloat16")  # the compute dtypes the CLI offers; float64 is the exactness mode


def dtype_name(dtype: Any) -> str:
    """A compute dtype as its torch name: ``"float32"``, ``"torch.float32"`` and ``torch.float32`` -> ``"float32"``
    (any torch dtype is taken as it is; a string must name one of :data:`DTYPES`).

    Raises
    ------
    InvalidArgumentError
        A string that names none of :data:`DTYPES`, or a value that is not a dtype.
    """
    name = str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and name in DTYPES:
        return name
    if not isinstance(dtype, str) and type(dtype).__name__ == "dtype" and type(dtype).__module__ == "torch":
        return name
    raise InvalidArgumentError(f"Expected a dtype among {', '.join(DTYPES)} (or a torch.dtype). Got {dtype!r}.")


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_budgets(text: str | None) -> list[tuple[str, int]]:
    """``"cuda:0=8GiB,cpu=32GiB"`` -> ``[("cuda:0", 8 * 2**30), ("cpu", 32 * 2**30)]`` (devices as written; the
    engine's :func:`~detjac.engine.memory.parse_memory` names them as torch does); empty or None -> ``[]``. Read
    without torch, so the CLI refuses a mistyped ``--max-memory`` before anything heavy is imported.

    Raises
    ------
    InvalidArgumentError
        Text that is not ``DEVICE=SIZE[,DEVICE=SIZE]``.
    """
    if text is None or not text.strip():
        return []
    budgets = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*([a-z]+(?::\d+)?)\s*=\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", part, flags=re.IGNORECASE)
        if m is None or m.group(2).count(".") > 1:
            raise InvalidArgumentError(
                f"Expected --max-memory as DEVICE=SIZE[,DEVICE=SIZE] (e.g. cuda:0=8GiB,cpu=32GiB). Got {text!r}."
            )
        budgets.append((m.group(1), int(float(m.group(2)) * _UNITS[(m.group(3) or "").upper()])))
    return budgets


def wants_streamed(streamed: bool, max_memory: Any = None, quantize: str | None = None) -> bool:
    """Whether a model loads into the layer-streamed engine: asked for, or implied by a memory budget (only it sizes
    its blocks to one) or by quantizing on load (only it quantizes). Read through :attr:`LoadSpec.streamed_engine`;
    a run's layerwise targets (a lens, ``--layers``) ask for it by setting ``streamed``."""
    return bool(streamed or max_memory or quantize)


@dataclass(frozen=True, kw_only=True)
class LoadSpec:
    """What to load and how: the one description every loader takes (:func:`detjac.engine.load_engine`).

    ``model`` is the model reference resolved once, at the edge (a :class:`~detjac.engine.ModelRef`: ``--gguf-file``
    and ``--revision`` are consumed there; None until the caller names the model); the compute ``dtype`` (a torch
    dtype's name) and ``device``; the layer-streamed engine (``streamed``, implied by ``max_memory`` and ``quantize``:
    :attr:`streamed_engine`); per-device budgets (``max_memory``, ``"cuda:0=8GiB,cpu=32GiB"``); ``quantize`` on load
    (nf4, fp4, int8); ``detach`` (False: the ordinary Jacobian); the family's detach ``convention`` (None: its
    default); ``trust_remote_code``, carried to load time."""

    model: Any = None
    dtype: str = "float64"
    device: str = "cpu"
    streamed: bool = False
    max_memory: str | None = None
    quantize: str | None = None
    detach: bool = True
    convention: str | None = None
    trust_remote_code: bool = False

    @property
    def streamed_engine(self) -> bool:
        """Whether this spec loads the layer-streamed engine (:func:`wants_streamed`)."""
        return wants_streamed(self.streamed, self.max_memory, self.quantize)
