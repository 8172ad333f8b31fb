"""Neuron pages in the viewer (``detjac view ... --neurons neurons.zarr``): the pages of a store or of a graph file,
plus ``neurons`` (what the index holds: its shape, model and corpus) and ``neuron/<layer>/<index>`` (one neuron's
page: :func:`detjac.analysis.neuron_page`). ``static/neuron_page.js`` shows a page when a graph's neuron is clicked
and from a search box (layer, index); every text on it (the corpus's tokens) is set as text only.

The index must have been made with the model of the graph or store it is shown with: its weights' SHA-256 is
compared with the graph's (``metadata.info.weights_sha256``) or the store run's, and a difference is refused by
name before the server starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .jsonable import jsonable

if TYPE_CHECKING:
    from ..store import NeuronIndex

PREFIX = "neuron/"


class NeuronPages:
    """``pages`` (:class:`~detjac.view.pages.Pages` or :class:`~detjac.view.graph_file.GraphFile`) with the neuron
    pages of ``index`` added (see the module docstring)."""

    def __init__(self, pages: Any, index: NeuronIndex) -> None:
        self.pages, self.index = pages, index
        self.path = getattr(pages, "path", None)
        wanted = _model_digest(pages)
        if wanted is not None:
            index.check({"weights_sha256": wanted})

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
                             "model": {k: self.index.identity.get(k) for k in ("family", "weights_sha256")}})
        if key.startswith(PREFIX):
            from detjac.analysis import neuron_page

            parts = key.removeprefix(PREFIX).split("/")
            layers, per_layer = self.index.shape
            if len(parts) != 2 or not all(p.isdigit() and str(int(p)) == p for p in parts) or \
                    int(parts[0]) >= layers or int(parts[1]) >= per_layer:
                raise NotFound(key)
            return jsonable(neuron_page(self.index, int(parts[0]), int(parts[1])))
        data = self.pages.data(key)
        if key == "corpus":
            data = {**data, "neurons": True}
        return data

    def keys(self, prompt_ids: list[str] | None = None) -> Any:
        return self.pages.keys(prompt_ids)


def _model_digest(pages: Any) -> str | None:
    """The weights' SHA-256 of the model the pages show: a graph file's, or a store run's (None if unknown)."""
    graph = getattr(pages, "graph", None)
    if isinstance(graph, dict):
        found = graph.get("metadata", {}).get("info", {}).get("weights_sha256")
        return found if isinstance(found, str) else None
    view = getattr(pages, "view", None)
    run = getattr(view, "run", None) if view is not None else None
    found = run.get("weights_sha256") if isinstance(run, dict) else None
    return found if isinstance(found, str) else None
