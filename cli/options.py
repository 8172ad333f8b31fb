"""Click options, choices and value parsers shared by the command modules (no heavy imports).

Command modules import only this module and :mod:`detjac.cli.render` from the CLI package.
"""

from __future__ import annotations

from typing import Any

import click

from detjac.targets import OUTPUT

DTYPES = ("float64", "float32", "bfloat16")

TABLE_HELP = "Write the table to this file: Parquet for a .parquet suffix, else CSV."

def gguf_file_option(func: Any) -> Any:
    """``--gguf-file NAME``: a GGUF file inside the folder or hub id MODEL."""
    return click.option("--gguf-file", default=None, metavar="NAME",
                        help="Load the GGUF file NAME inside the folder or hub id MODEL (e.g. a hub repository of "
                             "quantized files); MODEL may also be a .gguf file itself.")(func)


def model_source(model: str, gguf_file: str | None, revision: str | None = None) -> str:
    """MODEL as the loaders take it: with ``--gguf-file``, the path of that GGUF file (a hub id's, in the cache)."""
    if gguf_file is None:
        return model
    from detjac.engine import resolve_model

    return str(resolve_model(model, gguf_file, revision))

_SCHEDULER_OPTIONS = [
    click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
                 help="LocalCluster worker processes (0: dask's threaded scheduler in this process)."),
    click.option("--memory-limit", default="2GiB", show_default=True, help="Memory limit per LocalCluster worker."),
    click.option("--scheduler", default=None, help="Address of an existing dask.distributed scheduler."),
]


def scheduler_options(func: Any) -> Any:
    """``--workers``, ``--memory-limit`` and ``--scheduler`` of the dask analyses."""
    for option in reversed(_SCHEDULER_OPTIONS):
        func = option(func)
    return func


def parse_token(value: str) -> int | None:
    """``--token``: ``combined`` -> None, else a token index (negative from the end)."""
    if value == "combined":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise click.BadParameter(f"Expected 'combined' or a token index. Got {value!r}.") from exc


def parse_target(value: str | None) -> str | None:
    """``--target``: ``output`` (the model's) -> None, else the layerwise target as given."""
    return None if value in (None, OUTPUT) else value


def parse_strengths(value: str) -> list[float]:
    """``--strengths``: comma-separated numbers, at least one."""
    try:
        values = [float(v) for v in value.split(",") if v.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"Expected comma-separated numbers such as 0,0.5,1,2. Got {value!r}.") from exc
    if not values:
        raise click.BadParameter(f"Expected at least one strength. Got {value!r}.")
    return values


def parse_concept_source(value: str) -> tuple[str, str]:
    """``--concept-from``: ``STORE:PROMPT_ID`` -> (store path, prompt id); the store path may hold colons."""
    path, sep, pid = value.rpartition(":")
    if not sep or not path or not pid:
        raise click.BadParameter(f"Expected STORE:PROMPT_ID (e.g. run.zarr:3f2a9c0d1e2b4a5f). Got {value!r}.")
    return path, pid
