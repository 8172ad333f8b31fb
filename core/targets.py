"""The target grammar: which Jacobian a name means, in one place for every layer of detjac.

``output``; ``layer.L``, ``attn.L``, ``mlp.L`` and their ``*_normed`` forms; ``resid_mid.L``; each of these also
``*_local``; ``to_output.L``. :meth:`Target.parse` reads a name (negative layers count from the end). Torch-free, so
the store and the analyses read names by the engine's rules. Meanings: docs/engine.md, "Targets"."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import InvalidArgumentError

BASE_COMPONENTS = ("layer", "attn", "mlp")  # the un-normed residual-stream targets (what the paper's figures norm)
NORMED_SUFFIX = "_normed"
RESID_MID = "resid_mid"
TO_OUTPUT = "to_output"
COMPONENTS = (*BASE_COMPONENTS, RESID_MID, *(c + NORMED_SUFFIX for c in BASE_COMPONENTS), TO_OUTPUT)
LOCAL_SUFFIX = "_local"
OUTPUT = "output"
DEFAULT_ROW_BLOCK = 64  # the fewest rows the cost model puts in a block without a budget (engine/cost.py)
_NAME = re.compile(r"([a-z_]+?)(_local)?\.(-?\d+)")

# The array a layerwise target's Jacobian multiplies when it is not the input embeddings (store names).
INPUTS = "inputs"  # *_local targets: the layer's input hidden states (token, col)
INPUT = "input"  # to_output targets: the layer's output hidden states h_L (token, col)


@dataclass(frozen=True, order=True)
class Target:
    """One Jacobian the engine can compute (meanings: docs/engine.md, "Targets").

    Attributes
    ----------
    layer : int
        The decoder layer (non-negative), or -1 for the model output.
    component : str
        ``"output"`` or one of :data:`COMPONENTS`.
    local : bool
        With respect to the layer's own input (``*_local``) instead of the input embeddings.
    """

    layer: int
    component: str
    local: bool = False

    @property
    def name(self) -> str:
        """``output``, ``layer.3``, ``mlp_local.0``, ``to_output.2``, ..."""
        if self.component == OUTPUT:
            return OUTPUT
        return f"{self.component}{LOCAL_SUFFIX if self.local else ''}.{self.layer}"

    @property
    def is_output(self) -> bool:
        return self.component == OUTPUT

    @property
    def kind(self) -> str:
        """The component with its ``_local`` suffix (``mlp_local``); ``output`` for the model output."""
        return self.component + (LOCAL_SUFFIX if self.local else "")

    @property
    def normed(self) -> bool:
        """Passed through the final norm, its scale frozen at the target's own value (``*_normed``)."""
        return self.component.endswith(NORMED_SUFFIX)

    @property
    def base(self) -> str:
        """The residual-stream vector the target is taken of: ``layer``, ``attn``, ``mlp``, ``resid_mid``,
        ``to_output`` or ``output`` (a normed target's component without ``_normed``)."""
        return self.component.removesuffix(NORMED_SUFFIX)

    @property
    def is_to_output(self) -> bool:
        return self.component == TO_OUTPUT

    @property
    def after_final_norm(self) -> bool:
        """Whether the target's rows live after the final norm (``output``, ``*_normed``, ``to_output``: decode them
        through the unembedding) rather than in the residual stream before it (through ``W_U diag(g)``)."""
        return self.is_output or self.normed or self.is_to_output

    @property
    def source_array(self) -> str | None:
        """The stored array the Jacobian multiplies (``inputs`` for ``*_local``, ``input`` for ``to_output``),
        or None for the input embeddings."""
        return INPUT if self.is_to_output else INPUTS if self.local else None

    @classmethod
    def parse(cls, name: str, n_layers: int | None = None) -> Target:
        """``output``, ``layer.3``, ``attn.-1``, ``mlp_local.3``, ``layer_normed.2``, ``to_output.1``, ...

        With ``n_layers`` a layer index is checked and a negative one counts from the end; without,
        it must be non-negative (a stored name).

        Raises
        ------
        InvalidArgumentError
            A name outside the grammar, or a layer index out of range.
        """
        if name == OUTPUT:
            return OUTPUTS
        m = _NAME.fullmatch(name) if isinstance(name, str) else None
        if m is None or m.group(1) + (m.group(2) or "") not in kinds():
            raise InvalidArgumentError(
                f"Expected a target 'output' or KIND.LAYER with KIND one of {', '.join(kinds())} "
                f"(e.g. 'attn.3'). Got {name!r}."
            )
        layer = int(m.group(3))
        if n_layers is not None:
            layer = layer_index(layer, n_layers)
        elif layer < 0:
            raise InvalidArgumentError(f"Expected a non-negative layer index in target {name!r}.")
        return cls(layer, m.group(1), bool(m.group(2)))


OUTPUTS = Target(-1, OUTPUT)
"""The model output's target."""


def layer_index(i: int, n_layers: int) -> int:
    """``i`` in ``[-n_layers, n_layers)`` as a non-negative layer index."""
    if not -n_layers <= i < n_layers:
        raise InvalidArgumentError(f"Expected a layer index in [-{n_layers}, {n_layers}). Got {i}.")
    return i % n_layers


def kinds() -> list[str]:
    """Every valid ``--components`` value: each component, and with ``_local`` all but ``to_output``."""
    return [*COMPONENTS, *(c + LOCAL_SUFFIX for c in COMPONENTS if c != TO_OUTPUT)]


def parse_components(components: str | Sequence[str]) -> list[str]:
    """``--components`` as a list of kinds (``layer,attn_normed,to_output``), checked before any model loads.

    Raises
    ------
    InvalidArgumentError
        An unknown component (the message lists the valid ones), or none.
    """
    names = [c.strip() for c in components.split(",")] if isinstance(components, str) else list(components)
    allowed = kinds()
    bad = [c for c in names if c not in allowed]
    if bad or not names:
        raise InvalidArgumentError(
            f"Expected --components among {', '.join(allowed)}. Got {', '.join(map(repr, bad)) or 'none'}."
        )
    return names


def parse_layers(text: str) -> list[int] | None:
    """``--layers`` as every command reads it: ``all`` (any case, spaces around it ignored) -> None, else the
    comma-separated layer indices (negative ones count from the end; resolved against a model by
    :func:`layer_index`).

    Raises
    ------
    InvalidArgumentError
        Anything that is not ``all`` or at least one integer.
    """
    if text.strip().lower() == "all":
        return None
    try:
        picked = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise InvalidArgumentError(
            f"Expected --layers 'all' or comma-separated layer indices (e.g. 0,5,10). Got {text!r}.") from None
    if not picked:
        raise InvalidArgumentError(f"Expected at least one layer in --layers. Got {text!r}.")
    return picked


def layer_targets(layers: str | Sequence[int], components: str | Sequence[str], n_layers: int) -> list[Target]:
    """Targets for ``--layers all|0,5,10`` and ``--components layer,attn,mlp[,...]`` (:func:`kinds`), sorted.

    Raises
    ------
    InvalidArgumentError
        Layers that are not ``all`` or integers, an unknown component, or nothing picked.
    """
    picked = (parse_layers(layers) or list(range(n_layers))) if isinstance(layers, str) else list(layers)
    names = parse_components(components)
    if not picked:
        raise InvalidArgumentError(f"Expected at least one layer in --layers. Got {layers!r}.")
    out = {Target(layer_index(i, n_layers), c.removesuffix(LOCAL_SUFFIX), c.endswith(LOCAL_SUFFIX))
           for i in picked for c in names}
    return sorted(out)
