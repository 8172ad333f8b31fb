"""``detjac store ls|info|verify|export``: look into a store written by ``detjac run``."""

from __future__ import annotations

import json

import click


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

    \b
    Example:
      detjac store ls run.zarr --contains "Oak"
    """
    from detjac.store import open_store

    st = open_store(path)
    for p in st.prompts(contains=contains):
        a = p.attrs
        click.echo(f"{p.id}  {a['n_tokens']:>4} tok  err {a['reconstruction_error']:.1e}  "
                   f"next {a.get('next_token')!r:<12} {a['prompt'][:70]!r}")


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
    from detjac.store import open_store

    st = open_store(path)
    if prompt_id is not None:
        prompt = st.get(prompt_id)
        click.echo(json.dumps(prompt.attrs, indent=2, ensure_ascii=False))
        if prompt.low_rank:
            U, S, V = prompt.triplets()
            click.echo(f"low rank: combined U {U.shape}, S {S.shape}, V {V.shape}; per-token triplets of rank "
                       f"{S.shape[0]} for {prompt.n_tokens} tokens")
        else:
            arr = prompt.jacobian()
            click.echo(f"jacobian {tuple(arr.shape)} {arr.dtype}, chunks {arr.chunksize}")
        return
    size = sum(f.stat().st_size for f in st.path.rglob("*") if f.is_file())
    click.echo(f"store {path}: format version {st.format_version}, created {st.created}")
    click.echo(json.dumps(st.run, indent=2, ensure_ascii=False))
    leftovers = st.staging_leftovers()
    failures = st.failures()
    click.echo(f"{len(st)} complete prompts, {size / 2**20:.1f} MiB on disk"
               + (f"; {len(leftovers)} partial prompts in staging (redone on the next run)" if leftovers else "")
               + (f"; {len(failures)} failed prompts (retried by the next run):" if failures else ""))
    for pid, record in failures.items():
        click.echo(f"  {pid}  line {record.get('line')} ({record.get('stage')}, {record.get('error')}): "
                   f"{record.get('reason')}")


@store.command()
@click.argument("path", type=click.Path())
def verify(path: str) -> None:
    """Re-read every complete prompt: chunk checksums and sum_k J_k x_k against the stored output.

    Exits with status 1 if any prompt is corrupt, naming each.

    \b
    Example:
      detjac store verify run.zarr
    """
    from detjac.store import open_store

    results = open_store(path).verify(progress=True)
    bad = [r for r in results if not r.ok]
    for r in bad:
        click.echo(f"CORRUPT {r.id}: {r.reason}")
    worst = max((r.reconstruction_error for r in results if r.ok and r.reconstruction_error is not None), default=0.0)
    click.echo(f"{len(results) - len(bad)} of {len(results)} prompts ok (worst reconstruction error {worst:.2e}); "
               f"{len(bad)} corrupt")
    if bad:
        raise SystemExit(1)


@store.command()
@click.argument("path", type=click.Path())
@click.argument("prompt_id")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="Output .npz file.")
def export(path: str, prompt_id: str, out: str) -> None:
    """Write one prompt's arrays and metadata to a numpy .npz file (no pickles).

    \b
    Example:
      detjac store export run.zarr 3f2a9c0d1e2b4a5f --out prompt.npz
    """
    import numpy as np

    from detjac.store import open_store

    prompt = open_store(path).get(prompt_id)
    arrays = {name: prompt.array(name) for name in ("embeddings", "output", "token_ids")}
    if prompt.bias() is not None:
        arrays["bias"] = prompt.bias()
    if prompt.low_rank:
        arrays.update({f"combined_{x}": a for x, a in zip("USV", prompt.triplets(), strict=True)})
        arrays.update({name: prompt.array(name) for name in ("token_U", "token_S", "token_V", "token_frobenius_sq")})
    else:
        arrays["jacobian"] = prompt.jacobian(lazy=False)
    np.savez(out, attrs=np.array(json.dumps(prompt.attrs)), **arrays)
    click.echo(f"wrote {out}")
