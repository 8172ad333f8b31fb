"""The dask client's life cycle (runs/scheduler.py): what it reports, its settings, its quiet shutdown."""

from __future__ import annotations

import logging

import pytest

from detjac.runs.scheduler import (
    LOST_WORKER_TIMEOUT,
    ClusterInfo,
    ClusterOptions,
    _quiet_shutdown,
    dashboard,
    dask_cluster,
)


def test_cluster_info_describes_a_local_cluster_and_a_scheduler():
    local = ClusterInfo("tcp://127.0.0.1:4001", 2, "http://127.0.0.1:8787/status", True, "2GiB")
    assert local.describe() == "dask LocalCluster: 2 workers x 2GiB, dashboard http://127.0.0.1:8787/status"
    remote = ClusterInfo("tcp://10.0.0.5:8786", 3, "none", False)
    assert remote.describe() == "dask scheduler tcp://10.0.0.5:8786 (3 workers), dashboard none"


def test_dashboard_link_or_why_there_is_none():
    class Linked:
        dashboard_link = "http://h:1/status"

    class Empty:
        dashboard_link = ""

    class Without:
        @property
        def dashboard_link(self):
            raise KeyError("dashboard")

    assert dashboard(Linked()) == "http://h:1/status"
    assert dashboard(Empty()) == "none"
    assert dashboard(Without()) == "none (the scheduler runs without one)"


def test_quiet_shutdown_drops_only_the_slow_exit_warning_and_only_inside():
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    nanny = logging.getLogger("distributed.nanny")
    handler = Keep(level=logging.WARNING)
    nanny.addHandler(handler)
    try:
        with _quiet_shutdown():
            nanny.warning("Worker process still alive after 4.0 seconds, killing")
            nanny.warning("Restarting worker")
        nanny.warning("Worker process still alive after 4.0 seconds, killing")
    finally:
        nanny.removeHandler(handler)
    assert seen == ["Restarting worker", "Worker process still alive after 4.0 seconds, killing"]


def test_without_workers_or_scheduler_there_is_no_client_and_nothing_is_logged():
    logged: list[str] = []
    with dask_cluster(ClusterOptions(0, None, "1GiB"), log=logged.append) as client:
        assert client is None
    assert logged == []


@pytest.mark.slow
def test_a_local_cluster_on_loopback_then_a_client_of_its_scheduler():
    import dask
    import distributed  # noqa: F401 - its defaults are in dask's config from here on

    logged: list[str] = []
    setting = "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"
    default_trim = dask.config.get(setting, "unset")
    with dask_cluster(ClusterOptions(1, None, "1GiB"), trim_memory=False, log=logged.append) as client:
        assert dask.config.get("distributed.deploy.lost-worker-timeout") == LOST_WORKER_TIMEOUT
        assert dask.config.get(setting) is None  # not set in the workers' environment
        workers = client.scheduler_info()["workers"]
        assert len(workers) == 1 and all(w["nthreads"] == 1 for w in workers.values())
        assert all(a.startswith("tcp://127.0.0.1:") for a in [client.scheduler.address, *workers])
        assert all(w["memory_limit"] == 2**30 for w in workers.values())
        address = client.scheduler.address
        assert logged == [f"dask LocalCluster: 1 workers x 1GiB, dashboard {client.dashboard_link}"]
        assert client.dashboard_link.startswith("http://127.0.0.1:")
        with dask_cluster(ClusterOptions(0, address, "ignored"), log=logged.append) as other:
            assert other.submit(sum, [1, 2]).result() == 3
            assert logged[1] == f"dask scheduler {address} (1 workers), dashboard {dashboard(other)}"
    assert dask.config.get(setting, "unset") == default_trim  # the settings end with the cluster
    assert client.status == "closed"
