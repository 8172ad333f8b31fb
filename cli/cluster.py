"""The dask.distributed client that ``detjac run`` and ``detjac analyze`` use: an existing scheduler, or a
LocalCluster of worker processes on this machine (loopback only)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import click

LOST_WORKER_TIMEOUT = "120s"


@contextlib.contextmanager
def dask_client(workers: int, scheduler: str | None, memory_limit: str, trim_memory: bool = True) -> Iterator[Any]:
    """A client of ``scheduler``, or of a LocalCluster of ``workers`` processes with one thread each and
    ``memory_limit`` each, listening on 127.0.0.1 with the dashboard on a free port. Prints where it runs and
    the dashboard link; the LocalCluster is closed on exit.

    ``trim_memory=False`` starts the LocalCluster's workers without dask's ``MALLOC_TRIM_THRESHOLD_``: the
    engine allocates and frees large buffers for every row block, and with glibc handing each back to the
    system at once a run was 25-40 % slower here (a ``detjac run`` of 8 prompts, in one process, with and
    without the variable)."""
    from distributed import Client, LocalCluster

    if scheduler is not None:
        with Client(scheduler) as client:
            n = len(client.nthreads())
            click.echo(f"dask scheduler {scheduler} ({n} workers), dashboard {dashboard(client)}")
            yield client
        return
    import dask

    # A LocalCluster gives up on a dead worker's replacement that has not joined within this time (dask's
    # default, 15 s, is shorter than a worker's start on a busy machine that imports torch).
    settings: dict[str, Any] = {"distributed.deploy.lost-worker-timeout": LOST_WORKER_TIMEOUT}
    if not trim_memory:
        settings["distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"] = None  # None: not set at all
    with dask.config.set(settings), _quiet_shutdown(), \
            LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, memory_limit=memory_limit,
                         host="127.0.0.1", dashboard_address=":0") as cluster, Client(cluster) as client:
        click.echo(f"dask LocalCluster: {workers} workers x {memory_limit}, dashboard {dashboard(client)}")
        yield client


@contextlib.contextmanager
def _quiet_shutdown() -> Iterator[None]:
    """Drop the nanny's warning that a worker took over 4 s to exit when the cluster closes: with torch
    loaded, interpreter shutdown takes that long on a busy machine, and by then every prompt is committed."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Worker process still alive after")

    nanny = logging.getLogger("distributed.nanny")
    nanny.addFilter(keep)
    try:
        yield
    finally:
        nanny.removeFilter(keep)


def dashboard(client: Any) -> str:
    try:
        return client.dashboard_link or "none"
    except (KeyError, AttributeError):  # a scheduler started without a dashboard
        return "none (the scheduler runs without one)"
