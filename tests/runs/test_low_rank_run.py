"""`detjac run --keep rank:K`: the stored triplets against the full run's Jacobians, and the store commands on them."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from store_helpers import PROMPTS, write_prompts

from detjac.cli.main import main
from detjac.errors import StoreError
from detjac.store import open_store


@pytest.mark.slow
def test_low_rank_run_stores_triplets_close_to_the_full_run(tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:2])
    runner = CliRunner()
    for keep, out in (("full", "full.zarr"), ("rank:6", "low.zarr")):
        result = runner.invoke(main, ["run", "default", str(prompts), "--out", str(tmp_path / out), "--keep", keep])
        assert result.exit_code == 0, result.output
    full = {p.prompt: p for p in open_store(tmp_path / "full.zarr")}
    low = open_store(tmp_path / "low.zarr")
    assert low.run["keep"] == "rank:6" and len(low) == 2
    for p in low:
        J = full[p.prompt].jacobian(lazy=False)
        U, S, V = p.triplets()
        exact = np.linalg.svd(J.reshape(J.shape[0], -1), compute_uv=False)[:6]
        np.testing.assert_allclose(S, exact, rtol=1e-5)
        assert V.shape == (p.n_tokens, J.shape[2], 6) and U.shape == (J.shape[0], 6)
        Ut, St, Vt = p.triplets(-1)
        np.testing.assert_allclose(St, np.linalg.svd(J[:, -1, :], compute_uv=False)[:6], rtol=1e-8)
        assert p.attrs["reconstruction_error"] < 1e-12 and 0 < p.attrs["combined_captured"] <= 1
        with pytest.raises(StoreError, match="stored in low-rank mode"):
            p.jacobian()
        assert (tmp_path / "low.zarr" / "prompts" / p.id / "jacobian").exists() is False
    verify = runner.invoke(main, ["store", "verify", str(tmp_path / "low.zarr")])
    assert verify.exit_code == 0 and "2 of 2 prompts ok" in verify.output
    pid = low.prompt_ids()[0]
    info = runner.invoke(main, ["store", "info", str(tmp_path / "low.zarr"), pid])
    assert info.exit_code == 0 and "low rank: combined U (256, 6), S (6,)" in info.output
    assert runner.invoke(main, ["store", "export", str(tmp_path / "low.zarr"), pid, "--out",
                                str(tmp_path / "x.npz")]).exit_code == 0
    data = np.load(tmp_path / "x.npz", allow_pickle=False)
    assert "jacobian" not in data.files and np.array_equal(data["combined_S"], low.get(pid).triplets()[1])


def test_keep_is_validated(tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", PROMPTS[:1])
    args = ["run", "default", str(prompts), "--out", str(tmp_path / "s"), "--keep", "rank:0"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "Expected --keep full, --keep rank:K" in result.output
    assert not (tmp_path / "s").exists()
