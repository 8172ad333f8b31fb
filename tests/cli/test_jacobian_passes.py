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


def test_the_ordinary_pass_and_bfloat16_on_a_cpu_are_said_before_the_work():
    from detjac.cli.options import BF16_ON_CPU
    from detjac.runs.jacobian_run import ORDINARY_COSTS_MORE

    shown = " ".join(CliRunner().invoke(main, ["jacobian", "--help"]).output.split())
    assert "same cost" not in shown and "in memory more than twice the detached pass's time" in shown
    args = ["jacobian", "-p", "Oak", "--k", "1", "--top", "1"]
    both = CliRunner().invoke(main, args)
    assert both.exit_code == 0, both.output
    assert both.stderr.splitlines()[0] == ORDINARY_COSTS_MORE  # before the first pass's bar
    assert "more than twice the detached pass's time" in ORDINARY_COSTS_MORE and "--no-ordinary" in ORDINARY_COSTS_MORE
    assert ORDINARY_COSTS_MORE not in both.stdout  # the printed results (README's) stay as they are
    streamed = CliRunner().invoke(main, [*args, "--streamed"])  # layer-streamed: measured under twice, no note
    assert streamed.exit_code == 0 and ORDINARY_COSTS_MORE not in streamed.output, streamed.output
    alone = CliRunner().invoke(main, [*args, "--no-ordinary"])
    assert alone.exit_code == 0 and ORDINARY_COSTS_MORE not in alone.output and BF16_ON_CPU not in alone.output
    bf16 = CliRunner().invoke(main, [*args, "--no-ordinary", "--dtype", "bfloat16"])
    assert bf16.exit_code == 0, bf16.output
    assert bf16.stderr.splitlines()[0] == BF16_ON_CPU and bf16.output.count(BF16_ON_CPU) == 1
    assert "bfloat16 is a GPU dtype" in BF16_ON_CPU
