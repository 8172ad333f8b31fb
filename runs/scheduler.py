"""The dask.distributed client that ``detjac run`` and ``detjac analyze`` use: an existing scheduler, or a
LocalCluster of worker processes on this machine (loopback only).

Nothing here prints (where the client runs is a :class:`ClusterInfo` for the caller's ``log`` callback), and dask is
imported inside the functions."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

LOST_WORKER_TIMEOUT = "120s"
# The least memory a LocalCluster worker process takes (it imports torch, dask and the engine: ~0.4 GiB measured
# here before any model is loaded); more workers than the available memory holds at this size can only thrash.
WORKER_FLOOR = 512 * 2**20

Log = Callable[[str], None]


@dataclass(frozen=True)
class ClusterInfo:
    """Where a client runs: the scheduler's address, its workers, the dashboard link.

    ``memory_limit`` is set for a LocalCluster this process started (``local``), None for an
    existing scheduler.
    """

    address: str
    workers: int
    dashboard: str
    local: bool
    memory_limit: str | None = None

    def describe(self) -> str:
        """One line for the terminal, e.g. ``dask LocalCluster: 2 workers x 2GiB, dashboard http://...``."""
        if self.local:
            return f"dask LocalCluster: {self.workers} workers x {self.memory_limit}, dashboard {self.dashboard}"
        return f"dask scheduler {self.address} ({self.workers} workers), dashboard {self.dashboard}"


@dataclass(frozen=True)
class ClusterOptions:
    """Where a job's dask work runs (``--workers``, ``--scheduler``, ``--memory-limit``): a LocalCluster of
    ``workers`` processes of ``memory_limit`` each (``"auto"`` or a size such as ``"2GiB"``), an existing cluster at
    ``scheduler``, or, with neither, this process (:func:`dask_cluster`)."""

    workers: int = 0
    scheduler: str | None = None
    memory_limit: str = "auto"

    @property
    def distributed(self) -> bool:
        """Whether the work goes to a cluster (not this process)."""
        return self.scheduler is not None or self.workers > 0

    def check(self) -> None:
        """Refuse both ``workers`` and ``scheduler``, or more workers than this machine holds, before anything runs.

        Raises
        ------
        InvalidArgumentError
            Naming what was given.
        """
        from detjac.errors import InvalidArgumentError

        if self.scheduler is not None and self.workers:
            raise InvalidArgumentError(f"Expected either --scheduler (an existing cluster) or --workers (a "
                                       f"LocalCluster). Got both: --scheduler {self.scheduler} --workers "
                                       f"{self.workers}.")
        if self.scheduler is None:
            check_workers(self.workers, self.memory_limit)


def check_workers(workers: int, memory_limit: str, available: int | None = None) -> None:
    """Refuse a LocalCluster of more workers than this machine's memory holds.

    Parameters
    ----------
    workers : int
        Worker processes asked for (0: no LocalCluster; nothing to check).
    memory_limit : str
        ``--memory-limit``: ``"auto"`` or a size such as ``"2GiB"``; each worker is counted at this size, and at
        least :data:`WORKER_FLOOR`.
    available : int or None
        Bytes of memory available (None: as the operating system says now).

    Raises
    ------
    InvalidArgumentError
        A count above what fits, or a memory limit that is not a size; the message names both.
    """
    from detjac.errors import InvalidArgumentError

    if workers <= 0:
        return
    per = WORKER_FLOOR
    if memory_limit != "auto":
        from dask.utils import parse_bytes

        try:
            per = max(per, int(parse_bytes(memory_limit)))
        except (ValueError, TypeError):
            raise InvalidArgumentError(f"Expected --memory-limit auto or a size such as 2GiB. Got "
                                       f"{memory_limit!r}.") from None
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    if workers * per > available:
        raise InvalidArgumentError(f"Expected at most {available // per} --workers on this machine "
                                   f"({available / 2**30:.1f} GiB of memory available, {per / 2**30:.2f} GiB per "
                                   f"worker at least). Got --workers {workers}.")


@contextlib.contextmanager
def dask_cluster(options: ClusterOptions, *, trim_memory: bool = True, log: Log | None = None) -> Iterator[Any]:
    """A dask.distributed client of ``options.scheduler``, or of a LocalCluster of ``options.workers`` processes with
    one thread each and ``options.memory_limit`` each, listening on 127.0.0.1 with the dashboard on a free port
    (closed on exit); with neither, no client (None) and dask's threaded scheduler in this process. Hands where it
    runs and the dashboard link to ``log`` (:meth:`ClusterInfo.describe`).

    Without a client, dask's own progress bar reports every array computation that takes over two seconds (on
    stderr); with one, the dashboard shows the task stream.

    ``trim_memory=False`` starts the LocalCluster's workers without dask's ``MALLOC_TRIM_THRESHOLD_``: the
    engine allocates and frees large buffers for every row block, and with glibc handing each back to the
    system at once a run was 25-40 % slower here (a ``detjac run`` of 8 prompts, in one process, with and
    without the variable).

    Yields
    ------
    distributed.Client or None
    """
    if not options.distributed:
        from dask.diagnostics import ProgressBar

        # dt is also how long leaving the bar waits after each compute (0.5 s cost analyze svd 13 s of 15)
        with ProgressBar(minimum=2.0, dt=0.1, out=sys.stderr):
            yield None
        return
    from distributed import Client, LocalCluster

    if options.scheduler is not None:  # an existing cluster: --workers is not read
        with Client(options.scheduler) as client:
            _log(log, cluster_info(client, options.scheduler, local=False))
            yield client
        return
    check_workers(options.workers, options.memory_limit)
    import dask

    # A LocalCluster gives up on a dead worker's replacement that has not joined within this time (dask's
    # default, 15 s, is shorter than a worker's start on a busy machine that imports torch).
    settings: dict[str, Any] = {"distributed.deploy.lost-worker-timeout": LOST_WORKER_TIMEOUT}
    if not trim_memory:
        settings["distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"] = None  # None: not set at all
    workers, limit = options.workers, options.memory_limit
    with dask.config.set(settings), _quiet_shutdown(), \
            LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, memory_limit=limit,
                         host="127.0.0.1", dashboard_address=":0") as cluster, Client(cluster) as client:
        _log(log, cluster_info(client, cluster.scheduler_address, local=True, workers=workers, memory_limit=limit))
        yield client


def cluster_info(client: Any, address: str, *, local: bool, workers: int | None = None,
                 memory_limit: str | None = None) -> ClusterInfo:
    """Describe ``client``'s cluster at ``address`` (as the user gave it); ``workers`` defaults to the workers
    connected now."""
    n = len(client.nthreads()) if workers is None else workers
    return ClusterInfo(address, n, dashboard(client), local, memory_limit if local else None)


def _log(log: Log | None, info: ClusterInfo) -> None:
    if log is not None:
        log(info.describe())


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
    """The client's dashboard link, or why there is none."""
    try:
        return client.dashboard_link or "none"
    except (KeyError, AttributeError):  # a scheduler started without a dashboard
        return "none (the scheduler runs without one)"
