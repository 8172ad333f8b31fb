"""Neuron pages in the viewer (``detjac view ... --neurons neurons.zarr``): the pages of a store or of a graph file,
plus ``neurons`` (what the index holds: its shape, model and corpus) and ``neuron/<layer>/<index>`` (one neuron's
page: :func:`detjac.analysis.neuron_page`). ``static/neuron_page.js`` shows a page when a graph's neuron is clicked
and from a search box (layer, index); every text on it (the corpus's tokens) is set as text only.

In a static export (``detjac view ... --export DIR --neurons neurons.zarr``) the pages are those of the neurons of
the exported graphs only (:func:`graph_neurons`), not the whole index; ``neurons`` then lists them (``only``) and the
page's search box offers those.

The index must have been made with the model of the graph or store it is shown with: a graph's family, layer count
and neurons per layer (``metadata.info``) are compared with the index's whether or not the graph carries its weights'
SHA-256 (one written from Python may not), the digest too where it does, and every neuron node of the graph must lie
inside the index; a store run's family (``model_type``) and digest likewise. A difference is refused by name before
the server starts or a file is written."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from detjac.graph_nodes import NEURON, parse_node_id
from detjac.numerals import parse_index

from .jsonable import jsonable

if TYPE_CHECKING:
    from ..store import NeuronIndex

PREFIX = "neuron/"


class NeuronPages:
    """``pages`` (:class:`~detjac.view.pages.Pages` or :class:`~detjac.view.graph_file.GraphFile`) with the neuron
    pages of ``index`` added (see the module docstring); with ``only`` ((layer, neuron) pairs), those pages only, and
    :meth:`keys` lists them (what a static export writes)."""

    def __init__(self, pages: Any, index: NeuronIndex, only: Iterable[tuple[int, int]] | None = None) -> None:
        self.pages, self.index = pages, index
        self.only = None if only is None else sorted(set(only))
        self.path = getattr(pages, "path", None)
        index.check(_model_of(pages))
        if isinstance(getattr(pages, "graph", None), dict):
            graph_neurons(pages, ["graph"], index)  # refuses a neuron the index lacks

    def __len__(self) -> int:
        return len(self.pages)

    def __getattr__(self, name: str) -> Any:  # everything else is the pages'
        return getattr(self.pages, name)

    def refresh(self) -> bool:
        return bool(self.pages.refresh())

    def data(self, key: str) -> dict[str, Any]:
        from .pages import NotFound

        if key == "neurons":
            layers, per_layer = self.index.shape
            return jsonable({"layers": layers, "neurons": per_layer, "tokens": int(self.index.attrs["n_tokens"]),
                             "prompts": self.index.identity.get("prompts"), "k": self.index.identity.get("k"),
                             "only": None if self.only is None else [list(x) for x in self.only],
                             "model": {k: self.index.identity.get(k) for k in ("family", "weights_sha256")}})
        if key.startswith(PREFIX):
            from detjac.analysis import neuron_page

            parts = key.removeprefix(PREFIX).split("/")
            layers, per_layer = self.index.shape
            layer, neuron = (parse_index(parts[0], layers), parse_index(parts[1], per_layer)) if len(parts) == 2 \
                else (None, None)
            if layer is None or neuron is None or (self.only is not None and (layer, neuron) not in self.only):
                raise NotFound(key)
            return jsonable(neuron_page(self.index, layer, neuron))
        data = self.pages.data(key)
        if key == "corpus":
            data = {**data, "neurons": True}
        return data

    def keys(self, prompt_ids: list[str] | None = None) -> list[str]:
        """The pages' keys, then (with ``only``) ``neurons`` and each neuron page's key."""
        keys = list(self.pages.keys(prompt_ids))
        if self.only is None:
            return keys
        return [*keys, "neurons", *(f"{PREFIX}{layer}/{neuron}" for layer, neuron in self.only)]


def graph_neurons(pages: Any, keys: Iterable[str], index: NeuronIndex) -> list[tuple[int, int]]:
    """The (layer, neuron) of every neuron node (:data:`detjac.graph_nodes.NEURON`) of the graphs among
    the pages ``keys`` (``graph``, ``prompt/<id>/graph``), sorted, each once; NeuronIndexMismatch for one outside
    the index (a graph of another model)."""
    from ..store import NeuronIndexMismatch

    layers, per_layer = index.shape
    found = set()
    for key in keys:
        if key != "graph" and not key.endswith("/graph"):
            continue
        for node in pages.data(key)["nodes"]:
            key = parse_node_id(NEURON, node["id"]) if node["type"] == NEURON.name else None
            if key is None:
                continue
            layer, neuron, _ = key
            if not (0 <= layer < layers and 0 <= neuron < per_layer):
                raise NeuronIndexMismatch(f"Expected the graph's neurons inside the neuron index {index.path} "
                                          f"({layers} layers x {per_layer} neurons). Got neuron {node['id']} "
                                          f"(layer {layer}, neuron {neuron}): a graph of another model.")
            found.add((layer, neuron))
    return sorted(found)


# what a graph's ``metadata.info`` and a store's ``run`` say of their model, compared with an index's identity
GRAPH_MODEL = ("family", "n_layers", "neurons_per_layer", "weights_sha256")
RUN_MODEL = ("model_type", "weights_sha256")


def _model_of(pages: Any) -> dict[str, Any]:
    """What the pages say of their model (a graph file's ``metadata.info``, a store's run), the keys of
    :data:`GRAPH_MODEL` or :data:`RUN_MODEL` they hold: each is compared with the index's."""
    graph = getattr(pages, "graph", None)
    if isinstance(graph, dict):
        info = graph.get("metadata", {}).get("info", {})
        said, keys = (info if isinstance(info, dict) else {}), GRAPH_MODEL
    else:
        view = getattr(pages, "view", None)
        run = getattr(view, "run", None) if view is not None else None
        said, keys = (run if isinstance(run, dict) else {}), RUN_MODEL
    return {k: said[k] for k in keys if isinstance(said.get(k), str | int) and not isinstance(said.get(k), bool)}
