"""``detjac jacobian --no-ordinary`` skips the ordinary Jacobian's pass; each pass's progress bar
carries its own label (the two shared one, and read as one bar running backwards)."""

from __future__ import annotations

from click.testing import CliRunner

from detjac.cli.main import main


def test_each_pass_has_its_labelled_bar_and_the_ordinary_one_can_be_skipped():
    args = ["jacobian", "-p", "Oak", "--k", "1", "--top", "1", "--streamed"]  # its passes sweep in blocks, with bars
    both, alone = CliRunner().invoke(main, args), CliRunner().invoke(main, [*args, "--no-ordinary"])
    assert both.exit_code == 0 and alone.exit_code == 0, both.output + alone.output
    bars = [line.split(":")[0] for line in both.stderr.splitlines() if ": blocks:" in line]
    assert bars == ["detached Jacobian", "ordinary Jacobian"], both.stderr
    assert [line.split(":")[0] for line in alone.stderr.splitlines() if ": blocks:" in line] == ["detached Jacobian"]
    assert "ordinary not computed (--no-ordinary)" in alone.stdout and "ordinary not computed" not in both.stdout
    detached = [line for line in both.stdout.splitlines() if line.startswith("reconstruction error")][0].split()[3]
    assert float(detached) < 1e-12 and detached in alone.stdout  # the same detached Jacobian either way
