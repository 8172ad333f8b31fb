"""``detjac analyze columns|image|path``: three views of stored Jacobians, as PNG figures (and a table).

The numbers come from :mod:`detjac.analysis.views`, the figures from :mod:`detjac.analysis.view_plots`;
this module parses, calls them and prints.
"""

from __future__ import annotations

import click

from detjac.targets import OUTPUT

from .options import check_results, parse_target, prompt_id_option

TARGET_HELP = "'output' (the model's), or a stored layerwise target such as layer.2, layer_normed.3, to_output.1."


def _prompt(store, prompt_id: str | None) -> str:  # noqa: ANN001 - a JacobianStore
    return prompt_id or store.prompt_ids()[0]


@click.command("columns")
@click.argument("path", type=click.Path())
@prompt_id_option(multiple=False, help="A stored prompt's id (default: the first).")
@click.option("--target", default=OUTPUT, show_default=True, help=TARGET_HELP)
@click.option("--token", "tokens", multiple=True, type=int, help="Token index (repeatable; default: every token).")
@click.option("--count", type=click.IntRange(min=1), default=8, show_default=True, help="Columns per token.")
@click.option("--top", type=click.IntRange(min=1), default=6, show_default=True, help="Decoded tokens per column.")
@click.option("--out", "-o", "out_dir", type=click.Path(file_okay=False), default="detjac-columns", show_default=True)
def columns_cmd(path: str, prompt_id: str | None, target: str, tokens: tuple[int, ...], count: int, top: int,
                out_dir: str) -> None:
    """The largest-norm columns of each J_k, decoded to tokens (columns.csv, columns.png).

    A column c of J_k is how the target moves per unit of input dimension c of token k; the
    largest ones, signed along what J_k x_k produced, are decoded like left singular vectors.

    \b
    Examples:
      detjac analyze columns run.zarr --token -1 --count 10
      detjac analyze columns lw.zarr --target layer_normed.2 --out cols/
    """
    from pathlib import Path

    from detjac.analysis import largest_columns, piece_reader, plot_columns, write_table
    from detjac.store import open_store

    check_results([path], folders=(out_dir,))
    store = open_store(path)
    pid = _prompt(store, prompt_id)
    rows = largest_columns(store, pid, target=parse_target(target), tokens=list(tokens) or None, count=count, top=top)
    text, prompt = piece_reader(store), store.get(pid)
    labels = list(prompt.attrs.get("tokens") or [])
    for r in rows:
        click.echo(f"token {r['token']:>3} col {r['column']:>5} norm {r['norm']:>9.4g}  "
                   + " ".join(text(t) for t in r["decoded"]))
    out = Path(out_dir)
    written = [write_table(rows, out / "columns.csv"),
               plot_columns(rows, out / "columns.png", text, labels, f"{pid} {target}: {prompt.prompt[:80]}")]
    click.echo(f"wrote {', '.join(p.name for p in written)} to {out}")


@click.command("image")
@click.argument("path", type=click.Path())
@prompt_id_option(multiple=False, help="A stored prompt's id (default: the first).")
@click.option("--target", default=OUTPUT, show_default=True, help=TARGET_HELP)
@click.option("--token", type=int, default=-1, show_default=True, help="Token index (negative from the end).")
@click.option("--out", "-o", "png", type=click.Path(dir_okay=False), default="detjac-jacobian.png", show_default=True)
def image_cmd(path: str, prompt_id: str | None, target: str, token: int, png: str) -> None:
    """One token's J_k as an image, with its leading singular values (PNG).

    \b
    Examples:
      detjac analyze image run.zarr --token 0 --out j0.png
      detjac analyze image lw.zarr --target to_output.1 --token -1
    """
    from detjac.analysis import jacobian_image, plot_jacobian_image
    from detjac.store import open_store

    check_results([path], files=(png,))
    store = open_store(path)
    pid = _prompt(store, prompt_id)
    image = jacobian_image(store, pid, target=parse_target(target), token=token)
    s = image["singular_values"]
    click.echo(f"{pid} {image['target']} J_{image['token']}: {image['matrix'].shape[0]} x {image['matrix'].shape[1]}, "
               f"sigma_1 {s[0]:.4g}, stable rank {image['stable_rank']:.2f}")
    written = plot_jacobian_image(image, png, f"{pid} {image['target']}: J_{image['token']} of "
                                              f"{image['prompt'][:80]!r}")
    click.echo(f"wrote {written}")


@click.command("path")
@click.argument("path", type=click.Path())
@prompt_id_option(multiple=False, help="A stored prompt's id (default: the first).")
@click.option("--kind", default="layer", show_default=True,
              help="The layer targets to follow: layer, layer_normed, attn, mlp_normed, resid_mid, ...")
@click.option("--top", type=click.IntRange(min=1), default=3, show_default=True, help="Decoded tokens per vector.")
@click.option("--out", "-o", "out_dir", type=click.Path(file_okay=False), default="detjac-path", show_default=True)
def path_cmd(path: str, prompt_id: str | None, kind: str, top: int, out_dir: str) -> None:
    """Each layer's top two left singular vectors projected on the last layer's, across depth (path.csv, path.png).

    Needs `detjac run ... --layers all --components KIND`; the spectra are kept in the store.

    \b
    Examples:
      detjac analyze path lw.zarr
      detjac analyze path lw.zarr --kind layer_normed --out path-normed/
    """
    from pathlib import Path

    from detjac.analysis import piece_reader, plot_path, singular_path, write_table
    from detjac.store import open_store

    check_results([path], folders=(out_dir,))
    store = open_store(path)
    pid = _prompt(store, prompt_id)
    data = singular_path(store, pid, kind=kind, top=top)
    text = piece_reader(store)
    rows = [{"prompt_id": pid, "target": f"{kind}.{layer}", "layer": layer,
             **{f"u{i + 1}_projection": float(data["projections"][j, i]) for i in range(data["k"])},
             "u1_decoded": data["decoded"][j][0].tolist()} for j, layer in enumerate(data["layers"])]
    for r in rows:
        click.echo(f"{r['target']:<16} " + " ".join(f"{r[f'u{i + 1}_projection']:>7.3f}" for i in range(data["k"]))
                   + "  " + " ".join(text(t) for t in r["u1_decoded"]))
    out = Path(out_dir)
    written = [write_table(rows, out / "path.csv"),
               plot_path(data, out / "path.png", text, f"{pid} {kind}.L: {store.get(pid).prompt[:80]!r}")]
    click.echo(f"wrote {', '.join(p.name for p in written)} to {out}")


VIEW_COMMANDS = (columns_cmd, image_cmd, path_cmd)
