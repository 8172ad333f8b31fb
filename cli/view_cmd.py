"""``detjac view STORE``: browse a store (or one graph JSON file) in a local web page (read-only), or export the
pages for sharing."""

from __future__ import annotations

import click

from .options import prompt_id_option


@click.command()
@click.argument("path", type=click.Path())
@click.option("--port", type=click.IntRange(min=0, max=65535), default=0, show_default=True,
              help="Port to listen on (0: a free one).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but a loopback address lets other machines read the store.")
@click.option("--export", "export_dir", type=click.Path(file_okay=False), default=None,
              help="Write the pages as a static snapshot into this new folder instead of serving them.")
@prompt_id_option(multiple=True, help="With --export: only the prompt of this id (repeatable; default: all).")
@click.option("--attention", "attention", type=click.Path(dir_okay=False), multiple=True,
              help="With a graph JSON file: a `detjac attention --out` file of its prompt and model, shown as that "
                   "head's attention page (repeatable; files named GRAPH-STEM.qk.*.json beside the graph are "
                   "found without it).")
@click.option("--neurons", "neuron_index", default=None, type=click.Path(exists=True, file_okay=False),
              help="A neuron index of the same model (`detjac neurons`): a click on a graph's neuron, or the search "
                   "box (layer, index), shows its page: top contexts, histogram, logit effects. With --export: the "
                   "pages of the exported graphs' neurons only (not the whole index), opened offline.")
@click.option("--model", "model", default=None,
              help="With a graph JSON file: the graph's model (as `detjac graph` took it), loaded once, so that the "
                   "page's interventions panel can ablate or clamp its nodes (live viewer only).")
def view(path: str, port: int, host: str, export_dir: str | None, prompt_ids: tuple[str, ...],
         attention: tuple[str, ...], neuron_index: str | None, model: str | None) -> None:
    """Browse the store PATH (or the graph JSON file PATH) in a web browser: read-only, offline, on this
    machine by default.

    Serves a local page and prints its URL. The corpus page lists every prompt (search by
    text, sort by reconstruction error, length or next token) and the failed ones with their
    reasons. A prompt's page shows its tokens, the predicted next token, the reconstruction
    errors, the singular value spectra of [J_1 ... J_n] and of every J_k, and the top singular
    triplets decoded to tokens as `detjac analyze svd` decodes them (click a token for its J_k);
    with layerwise Jacobians, a layers tab per target kind. Results `detjac analyze` kept in the
    store are shown; others are computed in memory, never written to the store. A prompt with an
    attribution graph links to its graph page: nodes by layer and position, links by weight and
    sign, a node's labels and edges on click, pruning thresholds as sliders.

    PATH may also be a graph JSON file written by `detjac graph`: the page then shows that graph. A
    link loaded by `detjac graph --heads N` shows its head loadings on click; the heads panel ranks
    the heads by how much of the top logit's graph they carry and links each to its attention page
    (a `detjac attention --out` file given with --attention, or found beside the graph as
    GRAPH-STEM.qk.*.json), or shows the command that makes it.

    A graph written with `detjac graph --neurons INDEX --group` draws each group (supernode) as one
    node, its links its members' sums; a click expands it into its members.

    With --export DIR, the same pages are written into DIR (open DIR/index.html from disk); with
    --neurons too, the neuron pages of the exported graphs' neurons.

    With --model (a graph JSON file, served), the graph page's interventions panel ablates or
    clamps the selected nodes and shows the new top tokens as the exact linear system predicts
    them and as the model computes them.

    \b
    Examples:
      detjac view run.zarr
      detjac view run.zarr --port 8765
      detjac view run.zarr --host 0.0.0.0          # reachable from other machines: no password
      detjac view run.zarr --export run-pages/ && chromium run-pages/index.html
      detjac graph -p "Copper, n. A" --out copper.json && detjac view copper.json
      detjac attention -p "Copper, n. A" --layer 3 --head 1 --out copper.qk.L3.H1.json
      detjac view copper.json                      # finds copper.qk.*.json beside it
      detjac view copper.json --attention runs/qk-3-1.json
      detjac view copper.json --neurons neurons.zarr    # neuron pages (detjac neurons default prompts.txt ...)
      detjac view copper.json --neurons neurons.zarr --export copper-pages/   # with its neurons' pages
      detjac view copper.json --model default      # interventions on its nodes
    """
    from pathlib import Path

    from detjac.errors import StoreFormatError

    if path.endswith(".json") and Path(path).is_file():
        from detjac.view import GraphFile

        graph = GraphFile(path, attention)
        store: object = graph
        what = "the graph" + (f" and {len(graph.attention)} attention pages" if graph.attention else "")
    elif "://" not in path and not Path(path).is_dir():  # a local path that is no store: both kinds named
        expected = f"Expected a detjac store (a folder) or a graph JSON file (*.json, from `detjac graph`) at {path}."
        got = "a file of neither kind" if Path(path).exists() else "no such file or folder"
        raise StoreFormatError(f"{expected} Got {got}.")
    elif attention or model:
        raise click.UsageError(f"{'--attention' if attention else '--model'} applies to a graph JSON file (PATH "
                               "ending in .json), not to a store.")
    else:
        from detjac.store import open_store

        store = open_store(path)
        what = f"{len(store)} prompts"  # type: ignore[arg-type]
    neurons = None
    if neuron_index:
        from detjac.store import open_neuron_index

        neurons = open_neuron_index(neuron_index)
    if export_dir is not None:
        if model:
            raise click.UsageError("--model applies to the live viewer only: a static export cannot run a model.")
        _export(store, export_dir, list(prompt_ids) or None, neurons)
        return
    if prompt_ids:
        raise click.UsageError("--prompt-id applies to --export only (the server shows every prompt).")
    _serve(store, host, port, what, neurons, attention, _interventions(store, model) if model else None)


def _interventions(graph: object, model: str) -> object:
    """The graph's model loaded once, answering the page's interventions (:func:`detjac.runs.load_interventions`)."""
    from detjac.runs import load_interventions
    from detjac.view import graph_token_ids

    meta = graph.graph["metadata"]  # type: ignore[attr-defined]
    click.echo(f"loading {model} for interventions ...", err=True)  # stdout's first line is the URL
    return load_interventions(model, meta["prompt"], meta["prompt_tokens"],
                              graph_token_ids(graph.graph["nodes"]))  # type: ignore[attr-defined]


def _export(store: object, out: str, prompt_ids: list[str] | None, neurons: object = None) -> None:
    from detjac.progress import tqdm
    from detjac.view import export_static

    with tqdm(desc="export", unit="page") as bar:
        written = export_static(store, out, prompt_ids, progress=bar, neurons=neurons)  # type: ignore[arg-type]
    pages = sum(1 for path in written if path.name.startswith("neuron."))
    click.echo(f"wrote {len(written)} files to {out}" + (f" ({pages} neuron pages)" if neurons is not None else "") +
               f"; open {out.rstrip('/')}/index.html in a browser")


def _serve(store: object, host: str, port: int, what: str, neurons: object = None,
           attention: tuple[str, ...] = (), interventions: object = None) -> None:
    from detjac.view import make_server

    server = make_server(store, host, port, neurons, attention, interventions)  # type: ignore[arg-type]
    if not server.loopback:
        click.secho(f"Warning: listening on {host}, not a loopback address: anyone who can reach this machine on "
                    f"port {server.port} can read the store (there is no password).", fg="yellow", err=True)
    click.echo(f"detjac view: serving {what} of {store.path} at {server.url} "  # type: ignore[attr-defined]
               "(read-only; Ctrl-C to stop)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        click.echo("stopped")
    finally:
        server.server_close()
