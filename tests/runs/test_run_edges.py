"""Options at their edges: a --row-block above d_model runs (clamped to the rows there are), a --workers count the
machine's memory cannot hold is refused in one line before a store is created, and a URL with a host is refused."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from store_helpers import PROMPTS, write_prompts

from detjac.cli.main import main
from detjac.errors import InvalidArgumentError
from detjac.runs.scheduler import WORKER_FLOOR, check_workers
from detjac.store import open_store


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("row_block", [300, 2**63 - 1])
def test_a_row_block_above_d_model_runs_with_the_rows_there_are(tmp_path, row_block):
    prompts = write_prompts(tmp_path / "p.txt", ["A cat."])
    out = tmp_path / "s.zarr"
    result = invoke("run", "default", prompts, "--out", out, "--row-block", row_block)
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    store = open_store(out)
    assert store.run["row_block"] == 256 and len(store.prompt_ids()) == 1
    assert store.verify()[0].ok


def test_more_workers_than_memory_holds_are_refused_before_a_store_exists(tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:1])
    out = tmp_path / "s.zarr"
    result = invoke("run", "default", prompts, "--out", out, "--workers", 99999)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "Expected at most" in result.output and "Got --workers 99999." in result.output
    assert not out.exists()


def test_the_worker_bound_counts_the_memory_limit_and_a_floor():
    check_workers(4, "auto", available=4 * WORKER_FLOOR)
    with pytest.raises(InvalidArgumentError, match=r"Expected at most 4 --workers .* Got --workers 5\."):
        check_workers(5, "auto", available=4 * WORKER_FLOOR)
    with pytest.raises(InvalidArgumentError, match=r"Expected at most 2 --workers .* 2\.00 GiB per worker"):
        check_workers(3, "2GiB", available=5 * 2**30)
    with pytest.raises(InvalidArgumentError, match=r"Expected --memory-limit auto or a size such as 2GiB\. Got 'lots'"):
        check_workers(1, "lots", available=2**40)


def test_a_file_url_with_a_host_is_refused_not_written_under_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prompts = write_prompts(tmp_path / "p.txt", ["A cat."])
    result = invoke("run", "default", prompts, "--out", "file://host/data/s.zarr")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "Expected a file:// URL without a host (file:///path/to/store.zarr, three slashes). Got " \
           "'file://host/data/s.zarr', naming the host 'host'" in result.output
    assert not (tmp_path / "host").exists()
