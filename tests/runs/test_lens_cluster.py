"""A lens fitted on a 2-worker dask.distributed LocalCluster equals the one fitted in one process."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from detjac.analysis import lens as lenses
from detjac.analysis.lens import lens_fit
from detjac.store import open_store
from detjac.store.testing import make_store


@pytest.mark.slow
def test_a_two_worker_fit_equals_the_one_process_fit(tmp_path):
    synthetic = make_store(tmp_path / "s.zarr", prompts=7, d_model=6, n_tokens=4, n_layers=2,
                           targets=("to_output.0", "to_output.1"))
    from detjac.runs.scheduler import ClusterOptions, dask_cluster

    copy = tmp_path / "copy.zarr"
    shutil.copytree(synthetic.path, copy)
    lens_fit.fit_lens(open_store(copy), chunk=2)
    with dask_cluster(ClusterOptions(2, None, "1GiB")) as client:
        assert len(client.nthreads()) == 2
        lens_fit.fit_lens(open_store(synthetic.path), chunk=2)
    a, b = lenses.load_lens(synthetic.path), lenses.load_lens(copy)
    # two worker processes sum the partials in another order than one process: equal within float64 rounding
    assert np.abs(a.mean - b.mean).max() <= 1e-12 * np.abs(a.mean).max()
    assert np.abs(a.second_moment - b.second_moment).max() <= 1e-12 * np.abs(a.second_moment).max()
    assert np.array_equal(a.count, b.count) and np.array_equal(a.layers, b.layers)
