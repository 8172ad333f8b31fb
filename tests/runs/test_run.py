"""A corpus run from options to counts (runs/run.py): option checks, the log, the outcome, resuming."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from store_helpers import PROMPTS, write_prompts

from detjac.errors import InvalidArgumentError, StoreMismatchError
from detjac.model_settings import LoadSpec
from detjac.runs.run import RunOptions, RunOutcome, check_options, model_ref, run_corpus
from detjac.runs.scheduler import ClusterOptions
from detjac.store import open_store


@pytest.mark.parametrize(("changes", "message"), [
    ({"components": "attn"}, "Expected --layers with --components. Got --components attn alone."),
    ({"layers": "1", "keep": "rank:2"}, "Expected --keep full with --layers (layerwise Jacobians are stored whole). "
                                        "Got --keep rank:2."),
    ({"mode": "forward"}, "Expected --mode with the streamed engine (--streamed). Got --mode forward alone."),
    ({"cluster": ClusterOptions(2, "tcp://h:1")}, "Expected either --scheduler (an existing cluster) or --workers "
                                                "(a LocalCluster). Got both: --scheduler tcp://h:1 --workers 2."),
    ({"keep": "rank:0"}, "Expected --keep full, --keep rank:K with K a positive integer, or --keep none (with "
                          "--lens). Got 'rank:0'."),
])
def test_options_that_cannot_run_are_refused_before_anything_loads(changes, message, tmp_path):
    with pytest.raises(InvalidArgumentError) as info:
        check_options(RunOptions(**changes))
    assert str(info.value) == message
    with pytest.raises(InvalidArgumentError):  # run_corpus checks first: the missing prompts file is never read
        run_corpus("default", tmp_path / "missing.txt", str(tmp_path / "s.zarr"), RunOptions(**changes))
    assert not (tmp_path / "s.zarr").exists()


def test_the_streamed_engine_is_implied_by_layers_memory_budgets_and_quantization():
    assert not check_options(RunOptions()).load.streamed
    for changes in ({"layers": "all"}, {"lens": True}, {"load": LoadSpec(max_memory="cpu=4GiB")},
                    {"load": LoadSpec(quantize="nf4")}, {"load": LoadSpec(streamed=True)}):
        assert check_options(RunOptions(**changes)).load.streamed, changes
    assert check_options(RunOptions(layers="1", mode="forward")).mode == "forward"
    assert ClusterOptions(workers=2).distributed and ClusterOptions(scheduler="tcp://h:1").distributed
    assert not RunOptions().cluster.distributed


def test_exit_codes_and_model_references(tmp_path):
    summary = SimpleNamespace(failed={})
    assert RunOutcome(summary, "s", 1, False).exit_code == 0
    assert RunOutcome(SimpleNamespace(failed={"p": 1}), "s", 1, True).exit_code == 3
    assert RunOutcome(SimpleNamespace(failed={"p": 1}), "s", 1, True, interrupted=True).exit_code == 130
    assert model_ref("default") == "default"
    (tmp_path / "ckpt").mkdir()
    assert model_ref(str(tmp_path / "ckpt" / ".." / "ckpt")) == str((tmp_path / "ckpt").resolve())


@pytest.mark.slow
def test_a_run_logs_its_plan_counts_what_it_did_and_resumes(tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", [PROMPTS[0], "", PROMPTS[1], PROMPTS[0]])
    out = str(tmp_path / "s.zarr")
    logged: list[str] = []
    outcome = run_corpus("default", prompts, out, RunOptions(), log=logged.append)
    assert logged == [f"3 prompts in {prompts} (1 blank lines skipped, 1 duplicates); 0 already in {out}; "
                      "2 to compute."]
    s = outcome.summary
    assert (s.written, s.skipped_complete, s.duplicates, s.blank_lines, s.failed) == (2, 0, 1, 1, {})
    assert outcome.total == 2 and outcome.exit_code == 0 and not outcome.distributed and not outcome.interrupted
    assert 0 < s.worst_error < 1e-12
    assert sorted(p.prompt for p in open_store(out)) == sorted(PROMPTS[:2])
    again = run_corpus("default", prompts, out, RunOptions())  # no log: nothing to say
    assert (again.summary.written, again.summary.skipped_complete, again.total) == (0, 2, 2)
    ordinary = RunOptions(load=LoadSpec(detach=False))
    with pytest.raises(StoreMismatchError, match="Use --force-new to replace it"):  # another run's settings
        run_corpus("default", prompts, out, ordinary)
    replaced = run_corpus("default", prompts, out, replace(ordinary, force_new=True))
    assert replaced.summary.written == 2 and open_store(out).run["detach"] is False
