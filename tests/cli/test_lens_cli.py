"""``detjac lens fit`` on synthetic stores: the fit, and a store without to_output targets refused by name."""

from __future__ import annotations

from click.testing import CliRunner

from detjac.cli.main import main
from tests.store_factory import make_store


def test_fit_writes_the_lens_and_a_store_without_to_output_names_the_run_options(tmp_path):
    good = make_store(tmp_path / "s.zarr", prompts=3, d_model=4, n_layers=2, targets=("to_output.1",))
    out = CliRunner().invoke(main, ["lens", "fit", str(good.path), "--chunk", "2"])
    assert out.exit_code == 0, out.output
    assert "detached lens of 3 prompts, layers 1: 2 tasks now" in out.output
    again = CliRunner().invoke(main, ["lens", "fit", str(good.path)])
    assert "0 tasks now, 3 prompt-layers from earlier partial sums" in again.output
    plain = make_store(tmp_path / "p.zarr", prompts=1, targets=("layer.0",))
    bad = CliRunner().invoke(main, ["lens", "fit", str(plain.path)])
    assert bad.exit_code != 0 and "--components to_output" in bad.output and "Traceback" not in bad.output
    assert CliRunner().invoke(main, ["lens", "--help"]).output.count("detjac lens") >= 4
