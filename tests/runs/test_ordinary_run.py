"""`detjac run --ordinary`: ordinary Jacobians that do not reconstruct, stored and verified as such, compared
with the detached ones by `detjac analyze compare` (end to end, on the default model).

Moved from tests/analysis/test_analysis.py (compare itself is tested there on synthetic stores).
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from store_helpers import PROMPTS, run_default

from detjac.cli.main import main


@pytest.fixture(scope="module")
def real_store(tmp_path_factory):
    return run_default(tmp_path_factory.mktemp("analysis"), PROMPTS[:2], "s.zarr")


@pytest.mark.slow
def test_detached_against_ordinary(real_store, tmp_path):
    from store_helpers import PROMPTS as P

    store = run_default(tmp_path, P[:2], "ord.zarr", "--ordinary")
    ordinary = store.path
    assert store.run["detach"] is False and all(p.attrs["reconstruction_error"] > 1e-3 for p in store)
    assert all(r.ok for r in store.verify())
    plot = tmp_path / "c.png"
    out = CliRunner().invoke(main, ["analyze", "compare", str(real_store.path), str(ordinary), "--plot", str(plot),
                                    "--csv", str(tmp_path / "c.csv")])
    assert out.exit_code == 0, out.output
    assert "prediction among the top-10 decoded tokens of u_1: detached" in out.output
    assert plot.read_bytes()[:4] == b"\x89PNG" and len((tmp_path / "c.csv").read_text().splitlines()) == 3
    swapped = CliRunner().invoke(main, ["analyze", "compare", str(ordinary), str(real_store.path)])
    assert swapped.exit_code == 1 and "Expected a detached store first" in swapped.output
