"""``detjac view --export DIR``: the viewer's pages as a static snapshot that opens from disk.

Every page's data is computed ahead and written as ``data/<key>.js``, a script the page loads (a browser loads
scripts from ``file://`` where it refuses ``fetch``); nothing in it reaches the network. With a neuron index, the
snapshot holds the neuron pages of its graphs' neurons (:func:`~detjac.view.neuron_page.graph_neurons`), not the
whole index's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError, StoreError
from ..outputs import FOLDER, check_output, write_folder
from .assets import ASSETS, asset, data_script, index_html
from .graph_file import GraphFile
from .pages import Pages

if TYPE_CHECKING:
    from ..store import NeuronIndex, StoreReader


def data_file(key: str) -> str:
    """Where the data of page ``key`` goes in a snapshot: ``data/prompt.<id>.operator.3.js`` (the page's
    script computes the same name)."""
    return f"data/{key.replace('/', '.')}.js"


def export_static(store: StoreReader | GraphFile, out: str | Path, prompt_ids: Sequence[str] | None = None,
           progress: Any = None, neurons: NeuronIndex | None = None) -> list[Path]:
    """Write the snapshot of ``store`` (of ``prompt_ids`` only, when given) into the folder ``out``.

    Parameters
    ----------
    store : StoreReader or GraphFile
        A store, or one graph JSON file (its graph page only).
    out : str or Path
        A folder that does not exist yet or is empty.
    prompt_ids : sequence of str, optional
        Complete prompts of the store; the corpus page then lists these only.
    progress : tqdm-like, optional
        Updated once per page written; its ``total`` is set.
    neurons : NeuronIndex, optional
        A neuron index of the same model: the neuron page of every neuron node of the exported graphs is written
        too (``data/neuron.<layer>.<index>.js``), and ``data/neurons.js`` lists them.

    Returns
    -------
    list of Path
        The files written, ``index.html`` first.

    Raises
    ------
    InvalidArgumentError
        ``out`` is refused by :func:`detjac.outputs.check_output` (a file, a folder with something in it, a folder
        inside the store, the graph or the neuron index read, or inside any store or index), or a prompt id is not
        a complete prompt.
    NeuronIndexMismatch
        ``neurons`` was made with another model than the store's or the graph's.
    """
    what = "the graph" if isinstance(store, GraphFile) else "the store"
    reads = [(what, store.path), *([("the neuron index", neurons.path)] if neurons is not None else [])]
    out = check_output(out, kind=FOLDER, reads=reads)  # not into what is read, nor into any store or index
    pages: Any = store if isinstance(store, GraphFile) else Pages(store)
    known = set(store.prompt_ids())
    chosen = None if prompt_ids is None else list(dict.fromkeys(prompt_ids))
    missing = [pid for pid in chosen or [] if pid not in known]
    if missing:
        raise InvalidArgumentError(f"Expected complete prompts of {store.path}. Got {', '.join(missing)} (list them "
                                   "with `detjac store ls`).")
    keys = list(pages.keys(chosen))
    if neurons is not None:
        from .neuron_page import NeuronPages, graph_neurons

        with_neurons = NeuronPages(pages, neurons, only=())  # another model's index refused before any page is made
        with_neurons.only = graph_neurons(pages, keys, neurons)
        pages, keys = with_neurons, with_neurons.keys(chosen)
    if progress is not None:
        progress.total = len(keys)
    try:
        written = write_folder(out, lambda tmp: [p.relative_to(tmp) for p in _write(pages, keys, chosen, tmp,
                                                                                     progress)])
    except OSError as exc:
        raise StoreError(f"Expected to write the snapshot into {out}. Got {exc.strerror or exc} "
                         f"({type(exc).__name__}); nothing was left there.") from exc
    return [out / path for path in written]


def _write(pages: Any, keys: list[str], chosen: list[str] | None, out: Path, progress: Any) -> list[Path]:
    """Write the snapshot's files into the new folder ``out``; returns them, ``index.html`` first."""
    (out / "data").mkdir(parents=True)
    written = [out / "index.html"]
    written[0].write_bytes(index_html("static"))
    for name in ASSETS:
        (out / name).write_bytes(asset(name))
        written.append(out / name)
    for key in keys:
        data = pages.data(key)
        if key == "corpus" and chosen is not None:
            data = {**data, "prompts": [row for row in data["prompts"] if row["id"] in set(chosen)]}
        path = out / data_file(key)
        path.write_text(data_script(key, data).decode("ascii"), encoding="ascii")
        written.append(path)
        if progress is not None:
            progress.update()
    return written
