"""`detjac run --ordinary`: ordinary Jacobians that do not reconstruct, stored and verified as such, compared
with the detached ones by :func:`detjac.analysis.compare.compare` (end to end, on the default model).

Moved from tests/analysis/test_analysis.py (compare itself is tested there on synthetic stores).
"""

from __future__ import annotations

import pytest
from store_helpers import PROMPTS, run_default

from detjac.analysis.compare import compare


@pytest.fixture(scope="module")
def real_store(tmp_path_factory):
    return run_default(tmp_path_factory.mktemp("analysis"), PROMPTS[:2], "s.zarr")


@pytest.mark.slow
def test_detached_against_ordinary(real_store, tmp_path):
    from store_helpers import PROMPTS as P

    store = run_default(tmp_path, P[:2], "ord.zarr", "--ordinary")
    assert store.run["detach"] is False and all(p.attrs["reconstruction_error"] > 1e-3 for p in store)
    assert all(r.ok for r in store.verify())
    rows = compare(real_store, store)  # the real model's two stores, matched by text (the CLI: tests/analysis)
    assert sorted(r["prompt"] for r in rows) == sorted(P[:2])
    assert all(r["detached_error"] < 1e-9 < 1e-3 < r["ordinary_error"] for r in rows)
