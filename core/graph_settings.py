"""The attribution graphs' settings (:class:`GraphSettings`: one value, checked in one place), their defaults, and
what their kept share means, in one place for the engine, the runs, the CLI and the viewer (torch-free).

circuit-tracer's defaults, so that graphs compare: at most :data:`MAX_NODES` neurons enter the adjacency, and pruning
keeps the nodes holding :data:`NODE_THRESHOLD` and the edges holding :data:`EDGE_THRESHOLD` of the influence on the
logits (docs/graphs.md)."""

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from detjac.errors import InvalidArgumentError
from detjac.graph_nodes import LOGIT, NEURON, TOKEN

MAX_NODES = 7500  # neurons that enter the adjacency (circuit-tracer's default max_feature_nodes)
NODE_THRESHOLD = 0.8
EDGE_THRESHOLD = 0.98
MAX_LOGITS = 10  # logit targets: the top ones, at most this many ...
LOGIT_PROBABILITY = 0.95  # ... until their probabilities sum to this
HEADS_INTO = ("all", "logits")  # the links --heads chooses among: into any neuron or logit, or into the logits only
# How a graph's heads are ranked for their attention pages: by their exact direct effect on the target (every head)
# or by the share of the top logit they carry through the loaded links (detjac.view.top_heads)
HEAD_RANKINGS = ("effect", "share")

# What `metadata.info.logit_share_kept` is (graphs/document.py computes it), said the same way by
# `detjac graph` and the graph page.
KEPT_SHARE_MEANING = (
    "Kept share of a logit: the sum of the direct edges from the graph's kept nodes into it, divided by its value "
    "(the demeaned logit, or the asked target). Every source of the model, kept or not, sums exactly to that value, "
    "so 1 - share is what the neurons left out of the graph (pruned, or never ranked into it) put there directly. A "
    "negative share means the kept nodes together push the logit down (their edges sum to the opposite sign of its "
    "value) and the left-out neurons carry more than all of it; a share above 1 means the kept nodes overshoot and "
    "the left-out ones pull it back.")


@dataclass(frozen=True)
class GraphSettings:
    """What one attribution graph is computed with: the one value :func:`detjac.graphs.attribution_graph`, a
    ``--graph`` run (:class:`detjac.runs.RunOptions`, its stored description) and both commands' options carry.

    Attributes
    ----------
    max_nodes : int
        Neurons that enter the adjacency, ranked by their total attribution to the logits (probability weighted).
    node_threshold, edge_threshold : float
        The pruning (circuit-tracer's): the nodes, the edges holding this share of the influence on the logits.
    heads : int
        Links to split by attention head (0: none): the strongest ``|weight|`` among the links from a token or neuron
        to a neuron or logit that the graph pruned at the thresholds keeps (docs/graphs.md, "Head loadings").
    heads_into : str
        ``all`` (links into neurons and logits) or ``logits`` (only links into the logits).
    heads_up_to : bool
        A corpus run's: a graph with fewer links than ``heads`` has all of them split (else that is refused).
    max_logits, logit_probability : int, float
        The logit targets: the most probable tokens, at most ``max_logits``, until their probabilities reach
        ``logit_probability``.
    rows_per_pass : int or None
        Adjacency rows pulled back together (memory grows with it); None: from the engine's memory budget. How the
        graph is computed, not what it is: not part of :meth:`stored`.
    qk : tuple of (int, int)
        The heads (layer, head) whose exact QK attribution at the predicted position travels in the graph as a QK
        record (docs/graphs.md, "QK records"); ``--qk L.H`` each (:func:`parse_qk_head`).
    target : str or None
        One logit target instead of the top logits (:func:`parse_target`): ``"' Paris'"`` (its logit against the
        mean over the vocabulary), ``"' Paris' - ' London'"`` (a contrast), ``"' Paris' - mean"``.
    aside_first : bool
        Set the first position aside: the frozen system with the first position's own contribution (its embedding
        and the constants added there) removed, every listed number recomputed in it (docs/graphs.md, "Targets").
    """

    max_nodes: int = MAX_NODES
    node_threshold: float = NODE_THRESHOLD
    edge_threshold: float = EDGE_THRESHOLD
    heads: int = 0
    heads_into: str = "all"
    heads_up_to: bool = False
    max_logits: int = MAX_LOGITS
    logit_probability: float = LOGIT_PROBABILITY
    rows_per_pass: int | None = None
    qk: tuple[tuple[int, int], ...] = ()
    target: str | None = None
    aside_first: bool = False

    def check(self, flags: Mapping[str, str] | None = None) -> "GraphSettings":
        """These settings, or the error naming the first one out of range (by its name in ``flags``, a field's
        command-line option, where given; else as the Python keyword, ``--heads`` and ``--heads-into`` by flag).

        Raises
        ------
        InvalidArgumentError
            A non-positive ``max_nodes``, ``max_logits`` or ``rows_per_pass``, a probability outside (0, 1], a
            threshold outside [0, 1], a negative ``heads`` or an unknown ``heads_into``.
        """
        name = {"heads": "--heads", "heads_into": "--heads-into", **(flags or {})}.get
        for key in ("max_nodes", "max_logits", "rows_per_pass"):
            value = getattr(self, key)
            if (value is not None or key != "rows_per_pass") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidArgumentError(f"Expected {name(key, key)} to be a positive integer. Got {value!r}.")
        if not _number(self.logit_probability) or not 0.0 < self.logit_probability <= 1.0:
            raise InvalidArgumentError(f"Expected a logit probability in (0, 1]. Got {self.logit_probability!r}.")
        for key in ("node_threshold", "edge_threshold"):
            value = getattr(self, key)
            if not _number(value) or not 0.0 <= value <= 1.0:
                raise InvalidArgumentError(f"Expected {name(key, key)} in [0, 1]. Got {value!r}.")
        check_heads(self.heads, name("heads", "heads"))
        for pair in self.qk:
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair)):
                raise InvalidArgumentError(f"Expected each --qk head as (layer, head), two non-negative integers. Got "
                                           f"{pair!r}.")
        if len(set(self.qk)) != len(self.qk):
            raise InvalidArgumentError(f"Expected each --qk head once. Got {list(self.qk)}.")
        if self.target is not None:
            parse_target(self.target)
        if not isinstance(self.aside_first, bool):
            raise InvalidArgumentError(f"Expected aside_first to be True or False. Got {self.aside_first!r}.")
        if self.heads_into not in HEADS_INTO:
            raise InvalidArgumentError(f"Expected {name('heads_into', 'heads_into')} among {', '.join(HEADS_INTO)}. "
                                       f"Got {self.heads_into!r}.")
        return self

    def stored(self) -> dict[str, Any]:
        """The ``graph`` of a ``--graph`` run's description, key for key as stores keep it (and prompt ids hash it):
        ``max_nodes``, ``node_threshold``, ``edge_threshold``, ``heads`` only where some are split, ``qk`` only
        where some heads are traced, ``target`` and ``aside_first`` only where set (a run without keeps its
        identity)."""
        return {"max_nodes": int(self.max_nodes), "node_threshold": float(self.node_threshold),
                "edge_threshold": float(self.edge_threshold), **({"heads": int(self.heads)} if self.heads else {}),
                **({"qk": [list(pair) for pair in self.qk]} if self.qk else {}),
                **({"target": self.target} if self.target is not None else {}),
                **({"aside_first": True} if self.aside_first else {})}

    @classmethod
    def of_stored(cls, stored: Mapping[str, Any]) -> "GraphSettings":
        """The settings a ``--graph`` run's description (:meth:`stored`) names: its prompts' graphs are computed with
        them (each graph's links split up to ``heads``)."""
        return cls(max_nodes=stored["max_nodes"], node_threshold=stored["node_threshold"],
                   edge_threshold=stored["edge_threshold"], heads=stored.get("heads", 0), heads_up_to=True,
                   qk=tuple((int(layer), int(head)) for layer, head in stored.get("qk", ())),
                   target=stored.get("target"), aside_first=bool(stored.get("aside_first", False)))


@dataclass(frozen=True)
class LogitTarget:
    """A graph's one logit target, as :func:`parse_target` reads it: the logit of the token ``plus`` minus that of
    ``minus``, or minus the mean logit over the vocabulary where ``minus`` is None. A token is its text as the graph
    labels tokens (``' Paris'``, leading space included) or its id (an int)."""

    plus: str | int
    minus: str | int | None = None

    @property
    def text(self) -> str:
        """How the target is written back: ``' Paris' - ' London'``, ``' Paris' - mean``, ``#9 - #4``."""
        return f"{_item(self.plus)} - {'mean' if self.minus is None else _item(self.minus)}"


def _item(token: str | int) -> str:
    return f"#{token}" if isinstance(token, int) else repr(token)


_ITEM = r"""(?:'([^']*)'|"([^"]*)"|\#(\d+))"""
_TARGET = re.compile(rf"\s*{_ITEM}\s*(?:-\s*(?:{_ITEM}|(mean))\s*)?")


def parse_target(text: str) -> LogitTarget:
    """A logit target: a token in quotes (``' Paris'``: its logit against the mean; either quote, the other free
    inside it) or by id (``#9``), a contrast of two (``' Paris' - ' London'``) or ``' Paris' - mean``.

    Raises
    ------
    InvalidArgumentError
        Anything else, an empty token, or a contrast of a token with itself.
    """
    found = _TARGET.fullmatch(text) if isinstance(text, str) else None
    if found is None:
        raise InvalidArgumentError(f"Expected a target as a quoted token (or #ID), a contrast of two or a token "
                                   f"against the mean (\"' Paris'\", \"' Paris' - ' London'\", \"' Paris' - mean\"). "
                                   f"Got {text!r}.")
    plus, minus = _token(found[1], found[2], found[3]), _token(found[4], found[5], found[6])
    if plus == "" or minus == "":
        raise InvalidArgumentError(f"Expected a token's text inside each pair of quotes. Got {text!r}.")
    if minus is not None and minus == plus:
        raise InvalidArgumentError(f"Expected two different tokens in a contrast. Got {text!r}: the target would be 0.")
    return LogitTarget(plus, minus)


def _token(single: str | None, double: str | None, number: str | None) -> str | int | None:
    return single if single is not None else double if double is not None else int(number) if number else None


def parse_qk_head(text: str) -> tuple[int, int]:
    """``L.H`` (``3.1``; ``L3.H1`` too, as the heads panel names a head) -> (layer, head).

    Raises
    ------
    InvalidArgumentError
        Anything else.
    """
    found = re.fullmatch(r"\s*L?(\d+)\.H?(\d+)\s*", str(text))
    if found is None:
        raise InvalidArgumentError(f"Expected a head as LAYER.HEAD (e.g. 3.1 or L3.H1). Got {text!r}.")
    return int(found[1]), int(found[2])


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_heads(heads: Any, name: str = "--heads") -> int:
    """``--heads`` (links of a graph to split by attention head) as a non-negative integer.

    Raises
    ------
    InvalidArgumentError
        Anything else.
    """
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 0:
        raise InvalidArgumentError(f"Expected {name} to be a non-negative integer (links to split by attention "
                                   f"head). Got {heads!r}.")
    return heads


def first_crossed(kind: str, layer: int | None) -> int | None:
    """The first attention layer a link from a node of ``kind`` (the JSON's ``feature_type``) crosses: layer 0 from a
    token (``embedding``), the next layer from a neuron of ``layer`` (after its MLP); None from anything else (a bias
    node's links carry no head loadings)."""
    if kind == TOKEN.name:
        return 0
    return layer + 1 if kind == NEURON.name and layer is not None else None


def last_crossed(kind: str, layer: int | None, n_layers: int | None) -> int | None:
    """The last attention layer a link into a node of ``kind`` crosses: a neuron's own ``layer`` (its attention comes
    before its MLP), the model's last for a logit (None where ``n_layers`` is unknown); None for anything else."""
    if kind == NEURON.name and layer is not None:
        return layer
    return n_layers - 1 if kind == LOGIT.name and n_layers is not None else None


def crossed_layers(source: tuple[str, int | None], target: tuple[str, int | None],
                   n_layers: int | None) -> range | None:
    """The attention layers a graph's link crosses (docs/graphs.md, "Head loadings"): from :func:`first_crossed` of
    its source to :func:`last_crossed` of its target, inclusive.

    Parameters
    ----------
    source, target : tuple of (str, int or None)
        Each end's node kind (the JSON's ``feature_type``, a name of :data:`detjac.graph_nodes.KINDS`) and
        layer (a neuron's; None for the others).
    n_layers : int or None
        The model's layer count (None where unknown).

    Returns
    -------
    range or None
        The layers, empty for a link that crosses none (a last-layer neuron into a logit; a link from a bias node);
        None when it depends on the unknown ``n_layers`` (a link into a logit).
    """
    first, last = first_crossed(*source), last_crossed(*target, n_layers)
    if first is not None and target[0] == "logit" and n_layers is None:
        return None
    return range(0) if first is None or last is None else range(first, max(first, last + 1))
