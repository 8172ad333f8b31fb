"""``detjac store ls|info|verify|export``: look into a store written by ``detjac run``.

What is reported comes from :mod:`detjac.store.summary`; this module parses, calls it and prints.
"""

from __future__ import annotations

import click

from . import render


@click.group()
def store() -> None:
    """Inspect a store written by `detjac run`: ls, info, verify, export.

    \b
    Examples:
      detjac store ls run.zarr --contains "cat"
      detjac store info run.zarr
      detjac store verify run.zarr
      detjac store export run.zarr 3f2a9c0d1e2b4a5f --out prompt.npz
    """


@store.command("ls")
@click.argument("path", type=click.Path())
@click.option("--contains", default=None, help="Only prompts whose text contains this.")
def ls(path: str, contains: str | None) -> None:
    """List the complete prompts: id, tokens, reconstruction error, next token, text.

    A damaged prompt (changed attributes, a missing file) is listed as DAMAGED with the reason;
    `detjac store verify` checks every byte.

    \b
    Example:
      detjac store ls run.zarr --contains "Oak"
    """
    from detjac.store import listing, open_store

    for row in listing(open_store(path), contains):
        click.echo(render.listed_prompt(row))


@store.command()
@click.argument("path", type=click.Path())
@click.argument("prompt_id", required=False)
def info(path: str, prompt_id: str | None) -> None:
    """The run's description and counts, or one prompt's metadata.

    \b
    Examples:
      detjac store info run.zarr
      detjac store info run.zarr 3f2a9c0d1e2b4a5f
    """
    from detjac.store import open_store, prompt_layout, store_summary

    st = open_store(path)
    if prompt_id is not None:
        render.echo_prompt_layout(prompt_layout(st.get(prompt_id)))
    else:
        render.echo_store_summary(path, store_summary(st))


@store.command()
@click.argument("path", type=click.Path())
def verify(path: str) -> None:
    """Check everything a reader uses: every prompt on its own, the model arrays, stored analyses.

    Per prompt: attributes against the checksum written at commit, every file against its
    SHA-256, every chunk decoded (crc32c), token ids against the attributes, a --graph prompt's
    node and link tables forming its graph, and sum_k J_k x_k against the stored output within the
    bound of the run's dtype. Then the model arrays and
    tokenizer against their SHA-256s, analysis results, failure records, and anything that does
    not belong in a store (symlinks included). Exits with status 1 if anything is corrupt,
    naming each.

    \b
    Example:
      detjac store verify run.zarr
    """
    from detjac.store import open_store, verify_summary

    result = verify_summary(open_store(path), progress=True)
    render.echo_verify(result)
    if result.corrupt:
        raise SystemExit(1)


@store.command()
@click.argument("path", type=click.Path())
@click.argument("prompt_id")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False),
              help="Output file: .npz (the arrays) or .json (the prompt's attribution graph).")
@click.option("--force", is_flag=True, help="Replace the output file if it exists.")
def export(path: str, prompt_id: str, out: str, force: bool) -> None:
    """Write one prompt's arrays and metadata to a numpy .npz file (no pickles), or, with an --out
    ending in .json, its attribution graph (stored by `detjac run --graph`) as circuit-tracer's
    graph JSON (schema_version 1), which circuit-tracer's server and Neuronpedia open: its slug
    is the file's name, and graph-metadata.json beside it lists it.

    The file is written aside and renamed into place (a kill leaves the previous file or none); an
    existing one is replaced only with --force.

    \b
    Examples:
      detjac store export run.zarr 3f2a9c0d1e2b4a5f --out prompt.npz
      detjac store export graphs.zarr 3f2a9c0d1e2b4a5f --out graph.json
    """
    from detjac.outputs import check_output
    from detjac.store import export_graph, export_npz, npz_name, open_store

    graph = out.lower().endswith(".json")
    reads = [("the store", path)] if "://" not in path else []  # a URL's folder is checked once the store opens
    check_output(out if graph else npz_name(out), force=force, suffix=".json" if graph else ".npz",
                 reads=reads)  # before the store is opened
    if graph:
        click.echo(f"wrote {export_graph(open_store(path), prompt_id, out, force)}")
        return
    click.echo(f"wrote {export_npz(open_store(path), prompt_id, out, force)}")
