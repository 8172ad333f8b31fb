"""The target grammar: which Jacobian a name means, in one place for every layer of detjac.

A *target* is an output of the forward pass whose Jacobian detjac computes, at the target
position:

``output``
    The final normed hidden state (what :func:`detjac.engine.detached_jacobian` returns).
``layer.L``
    Decoder layer ``L``'s output (the residual stream after it).
``attn.L``, ``mlp.L``
    Layer ``L``'s attention and MLP blocks' contributions to the residual stream (post-norms
    included), so ``layer.L = layer.L-1 + attn.L + mlp.L``.
``layer_local.L``, ``attn_local.L``, ``mlp_local.L``
    The same, but with respect to layer ``L``'s own input instead of the input embeddings.

Negative layer indices count from the end when the number of layers is known
(:meth:`Target.parse`). Targets sort by layer, then component: the order the store lists
them in and the engine sweeps them. This module is torch-free, so the store and the
analyses read names with the same rules the engine writes them with.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import InvalidArgumentError

COMPONENTS = ("layer", "attn", "mlp")
LOCAL_SUFFIX = "_local"
OUTPUT = "output"
_NAME = re.compile(r"(layer|attn|mlp)(_local)?\.(-?\d+)")


@dataclass(frozen=True, order=True)
class Target:
    """One Jacobian the engine can compute (see the module docstring for the meanings).

    Attributes
    ----------
    layer : int
        The decoder layer (non-negative), or -1 for the model output.
    component : str
        ``"output"``, ``"layer"``, ``"attn"`` or ``"mlp"``.
    local : bool
        With respect to the layer's own input (``*_local``) instead of the input embeddings.
    """

    layer: int
    component: str
    local: bool = False

    @property
    def name(self) -> str:
        """``output``, ``layer.3``, ``mlp_local.0``, ..."""
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

    @classmethod
    def parse(cls, name: str, n_layers: int | None = None) -> Target:
        """``output``, ``layer.3``, ``attn.-1``, ``mlp_local.3``, ...

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
        if m is None:
            raise InvalidArgumentError(
                f"Expected a target 'output' or COMPONENT[_local].LAYER with COMPONENT one of "
                f"{', '.join(COMPONENTS)} (e.g. 'attn.3'). Got {name!r}."
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
    """Every component with and without ``_local``: ``layer, attn, mlp, layer_local, ...``."""
    return [*COMPONENTS, *(c + LOCAL_SUFFIX for c in COMPONENTS)]


def layer_targets(layers: str | Sequence[int], components: str | Sequence[str], n_layers: int) -> list[Target]:
    """Targets for ``--layers all|0,5,10`` and ``--components layer,attn,mlp[,*_local]``, sorted.

    Raises
    ------
    InvalidArgumentError
        Layers that are not ``all`` or integers, an unknown component, or nothing picked.
    """
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
    allowed = kinds()
    bad = [c for c in names if c not in allowed]
    if bad or not names or not picked:
        raise InvalidArgumentError(
            f"Expected at least one layer and components among {', '.join(allowed)}. "
            f"Got layers {layers!r} and components {components!r}."
        )
    out = {Target(layer_index(i, n_layers), c.removesuffix(LOCAL_SUFFIX), c.endswith(LOCAL_SUFFIX))
           for i in picked for c in names}
    return sorted(out)
