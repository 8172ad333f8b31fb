"""What must never reach a store: an export written into it, writes through a hard link to a file outside, JSON
that other zarr readers cannot parse; and what killed writes leave in it is reported by verify and cleared by the
next write there."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.errors import InvalidArgumentError, StoreError
from detjac.store import create_store, open_store
from detjac.store import format as fmt
from detjac.store.testing import make_store
from tests.store_helpers import store_snapshot


@pytest.fixture
def synthetic(tmp_path):
    return make_store(tmp_path / "s.zarr", prompts=2, d_model=4, n_tokens=3)


def gone_pid() -> int:
    """The id of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("inside", ["", "analysis/pages", "prompts/new"])
def test_an_export_into_the_store_it_shows_is_refused(synthetic, inside):
    from detjac.view.static_export import export_static

    before = store_snapshot(synthetic.path)
    target = synthetic.path / inside if inside else synthetic.path
    with pytest.raises(InvalidArgumentError, match="Expected an output outside the store .* which this command reads"):
        export_static(open_store(synthetic.path), target)
    link = synthetic.path.parent / "link"
    link.symlink_to(synthetic.path / "analysis", target_is_directory=True)
    result = CliRunner().invoke(main, ["view", str(synthetic.path), "--export", str(link / "pages")])
    assert result.exit_code == 1 and "outside the store" in result.output
    assert store_snapshot(synthetic.path) == before and not (synthetic.path / "analysis" / "pages").exists()


def test_leftovers_of_killed_writes_are_reported_then_cleared_by_the_next_write(synthetic):
    store = open_store(synthetic.path)
    pid = store.prompt_ids()[0]
    folder = synthetic.path / fmt.ANALYSIS / pid
    folder.mkdir(parents=True)
    (synthetic.path / fmt.ANALYSIS / "zarr.json").write_text(fmt.group_meta())
    (folder / "zarr.json").write_text(fmt.group_meta())
    dead, live = folder / f".svd_combined.tmp-{gone_pid()}", folder / f".other.tmp-{os.getpid()}"
    for left in (dead, live):
        left.mkdir()
        (left / "zarr.json").write_text("{")
    assert store.interrupted_writes() == [f"{fmt.ANALYSIS}/{pid}/{dead.name}"]  # a live writer's is not a leftover
    assert store.analysis_names(pid) == []
    result = CliRunner().invoke(main, ["store", "verify", str(synthetic.path)])
    assert result.exit_code == 0
    assert f"note: 1 leftovers of writes killed midway ({fmt.ANALYSIS}/{pid}/" in result.output
    store.write_analysis(pid, "svd_combined", {"S": np.ones(2)}, {})
    assert not dead.exists() and live.exists() and store.interrupted_writes() == []
    assert "leftovers" not in CliRunner().invoke(main, ["store", "verify", str(synthetic.path)]).output


def test_the_lock_file_is_never_written_through_a_hard_link(synthetic, tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("mine")
    lock_file = synthetic.path / fmt.WRITER / "zarr.json"
    lock_file.parent.mkdir(exist_ok=True)
    lock_file.unlink(missing_ok=True)
    os.link(outside, lock_file)
    with pytest.raises(StoreError, match="Got a file with 2 hard links"):
        create_store(synthetic.path, synthetic.run)
    assert outside.read_text() == "mine"


def test_nan_and_infinity_never_reach_a_stores_json(synthetic):
    # (prompt files holding NaN are refused when read: tests/runs/test_everyday.py)
    assert fmt.non_standard_json({"meta": {"scores": [1.0, math.inf]}}) == "meta.scores[1] = inf"
    assert fmt.non_standard_json({"meta": {"ok": [1.0, None, "NaN"]}}) is None
    with create_store(synthetic.path, synthetic.run) as store:
        writer = store.begin("0123456789abcdef", n_rows=4, n_tokens=3, n_cols=4, dtype="float64", row_block=3)
        writer.write_rows(0, 4, np.zeros((4, 3, 4)))
        for name, shape in (("embeddings", (3, 4)), ("output", (4,)), ("token_ids", (3,))):
            writer.write_array(name, np.zeros(shape, dtype=np.int64 if name == "token_ids" else np.float64))
        with pytest.raises(StoreError, match=r"Got meta.score = nan: nothing was committed"):
            writer.commit({"prompt": "x", "meta": {"score": float("nan")}})
    assert "0123456789abcdef" not in open_store(synthetic.path).prompt_ids()
    for meta in synthetic.path.rglob("zarr.json"):
        json.loads(meta.read_text(), parse_constant=lambda c, where=meta: pytest.fail(f"{c} in {where}"))
