"""Without --row-block, the commands that sweep leave the row block to the engine's plan (its cost
model, from the budget and the machine); --row-block overrides it, and --help says what the default does."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import detjac.engine as engine_api
from detjac.cli.main import main
from detjac.store import open_store


@pytest.mark.parametrize("given", [None, 8])
def test_jacobian_passes_no_row_block_through_unless_given(monkeypatch, given: int | None) -> None:
    seen: list[int | None] = []
    real = engine_api.exactness_report

    def spy(*args, **kwargs):
        seen.append(kwargs["row_block"])
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_api, "exactness_report", spy)
    args = ["jacobian", "-p", "Oak", "--k", "1", "--top", "1", "--no-ordinary"]
    res = CliRunner().invoke(main, args + ([] if given is None else ["--row-block", str(given)]))
    assert res.exit_code == 0, res.output
    assert seen == [given]


def test_a_run_without_row_block_stores_the_engines_own_blocks(tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("Oak, n. A tree\n")
    res = CliRunner().invoke(main, ["run", "default", str(prompts), "--out", str(tmp_path / "s.zarr")])
    assert res.exit_code == 0, res.output
    store = open_store(tmp_path / "s.zarr")
    assert store.run["row_block"] == "auto"  # no longer 64: each prompt's engine plans its own


@pytest.mark.parametrize("command", ["jacobian", "run"])
def test_row_block_help_says_what_the_default_does(command: str) -> None:
    out = " ".join(CliRunner().invoke(main, [command, "--help"]).output.split())
    assert "Default: chosen by the engine's cost model" in out and "[default: 64" not in out
