"""`detjac run --lens`: the lens accumulated during a run equals the one fitted from stored to_output targets, a
killed run resumes to the same lens, two workers merge their sums, and bad combinations are refused first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner
from store_helpers import PROMPTS, store_snapshot, write_prompts

from detjac.analysis import lens as lenses
from detjac.analysis.lens import lens_fit
from detjac.cli.main import main
from detjac.errors import InvalidArgumentError
from detjac.store import open_store

LINES = PROMPTS[:6]


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def run_ok(*args: str):
    result = invoke("run", *args)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def routes(tmp_path_factory, llama_checkpoint):
    """The tiny Llama's lens both ways, float64: stored to_output targets then `lens fit`, and `run --lens`."""
    folder = tmp_path_factory.mktemp("lensrun")
    prompts = write_prompts(folder / "p.txt", LINES)
    run_ok(llama_checkpoint, prompts, "--out", folder / "stored.zarr", "--layers", "all", "--components", "to_output")
    lens_fit.fit_lens(open_store(folder / "stored.zarr"), chunk=4)
    result = run_ok(llama_checkpoint, prompts, "--out", folder / "lens.zarr", "--lens", "--lens-flush", "4")
    return folder, prompts, result.output


def assert_same_lens(a, b, bound: float = 1e-12) -> None:
    assert np.array_equal(a.layers, b.layers) and np.array_equal(a.count, b.count)
    scale = np.abs(a.mean).max()
    assert np.abs(a.mean - b.mean).max() < bound * scale
    assert np.abs(a.second_moment - b.second_moment).max() < bound * np.abs(a.second_moment).max()


def test_the_run_lens_equals_the_stored_route_lens(routes):
    folder, _, output = routes
    stored, ran = lenses.load_lens(folder / "stored.zarr"), lenses.load_lens(folder / "lens.zarr")
    assert_same_lens(stored, ran)
    assert list(ran.count) == [len(LINES)] * 3 and ran.kind == "detached"
    assert f"lens: layers 0, 1, 2, {len(LINES)} prompts each" in output
    store = open_store(folder / "lens.zarr")
    assert store.run["lens"] == {"layers": [0, 1, 2], "target": "to_output"} and store.run["layerwise"] == []
    prompt = store.get(store.prompt_ids()[0])
    assert prompt.without_jacobian and prompt.layerwise_targets == [] and "no Jacobian" in repr(prompt)
    assert set(prompt.attrs["lens"]) == {"to_output.0", "to_output.1", "to_output.2"}
    assert max(prompt.attrs["lens"].values()) < 1e-12  # each layer's T rebuilt y from that layer's states
    with pytest.raises(Exception, match="keeps no Jacobian"):
        prompt.jacobian()
    by_text = {q.prompt: q for q in open_store(folder / "stored.zarr")}
    np.testing.assert_array_equal(prompt.array("output"), by_text[prompt.prompt].array("output"))
    np.testing.assert_array_equal(prompt.array("token_ids"), by_text[prompt.prompt].array("token_ids"))
    assert all(r.ok for r in store.verify())
    verify = CliRunner().invoke(main, ["store", "verify", str(folder / "lens.zarr")])
    assert verify.exit_code == 0 and "prompts ok (no Jacobian stored to reconstruct)" in verify.output
    from detjac.view.pages import Pages

    assert "operator" not in " ".join(Pages(store).keys())  # the viewer shows no operator page it cannot fill
    assert [n for n in store.lens_names() if n.startswith("partial")] == sorted(
        lens_fit.partial_name(layer, store.prompt_ids()) for layer in (0, 1, 2))  # one per layer after the merge
    again = lens_fit.fit_lens(store)  # `detjac lens fit` on a --lens store merges, computes nothing
    assert again["tasks"] == 0 and again["count"] == [len(LINES)] * 3
    assert_same_lens(stored, lenses.load_lens(folder / "lens.zarr"))


def test_keep_full_also_stores_the_output_jacobian(routes, llama_checkpoint, tmp_path):
    folder, prompts, _ = routes
    run_ok(llama_checkpoint, prompts, "--out", tmp_path / "full.zarr", "--lens", "--keep", "full", "--layers", "-1")
    store = open_store(tmp_path / "full.zarr")
    by_text = {q.prompt: q for q in open_store(folder / "stored.zarr")}
    for prompt in store:
        assert not prompt.without_jacobian
        np.testing.assert_allclose(prompt.jacobian(lazy=False), by_text[prompt.prompt].jacobian(lazy=False),
                                   rtol=0, atol=1e-13)
    lens = lenses.load_lens(tmp_path / "full.zarr")
    stored = lenses.load_lens(folder / "stored.zarr")
    assert list(lens.layers) == [2] and np.abs(lens.mean[0] - stored.mean[2]).max() < 1e-12 * np.abs(lens.mean).max()


def test_committed_prompts_whose_sums_were_lost_are_recomputed_and_counted_once(routes, llama_checkpoint, tmp_path,
                                                                                  monkeypatch):
    """A run that commits prompts but dies before its flush (simulated: flushes do nothing): the store has the
    prompts, no partial counts them, `lens fit` refuses it, and the same run again counts every one once."""
    from detjac.analysis.lens.lens_sums import RunningSums

    folder, prompts, _ = routes
    out = tmp_path / "lost.zarr"
    with monkeypatch.context() as patch:
        patch.setattr(RunningSums, "_flush", lambda self: None)
        result = invoke("run", llama_checkpoint, prompts, "--out", out, "--lens", "--lens-flush", "100")
    assert result.exit_code == 3 and f"lens: {len(LINES)} committed prompts are not counted" in result.output
    assert len(open_store(out)) == len(LINES) and not open_store(out).lens_names()
    with pytest.raises(InvalidArgumentError, match=f"Got {len(LINES)} of {len(LINES)} not counted"):
        lens_fit.fit_lens(open_store(out))
    result = run_ok(llama_checkpoint, prompts, "--out", out, "--lens")
    assert f"0 already in {out}; {len(LINES)} to compute" in result.output
    assert_same_lens(lenses.load_lens(folder / "stored.zarr"), lenses.load_lens(out))


def kill_after(command: list[str], out, prompts: int, timeout: float = 120.0) -> None:
    """Start ``command``, wait until ``prompts`` prompts are committed in ``out``, then SIGKILL it."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    folder = out / "prompts"
    while proc.poll() is None and time.monotonic() < deadline:
        if folder.is_dir() and sum(1 for p in folder.iterdir() if p.name != "zarr.json") >= prompts:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before the kill; the test did not test a crash"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("committed", [3, *(pytest.param(n, marks=pytest.mark.slow) for n in (1, 5))])
def test_a_run_killed_mid_way_resumes_to_the_same_lens(routes, llama_checkpoint, tmp_path, committed):
    folder, prompts, _ = routes
    out = tmp_path / "killed.zarr"
    command = [sys.executable, "-m", "detjac.cli.main", "run", str(llama_checkpoint), str(prompts), "--out", str(out),
               "--lens", "--lens-flush", "3"]
    kill_after(command, out, committed)
    store = open_store(out)
    assert 0 < len(store) < len(LINES) and all(r.ok for r in store.verify())
    assert "fitted" not in store.lens_names()
    run_ok(*command[4:])  # the same command again, in this process
    store = open_store(out)
    assert len(store) == len(LINES) and store.staging_leftovers() == []
    lens = lenses.load_lens(out)
    assert list(lens.count) == [len(LINES)] * 3
    assert_same_lens(lenses.load_lens(folder / "stored.zarr"), lens)


@pytest.mark.slow
def test_a_two_worker_lens_run_equals_the_one_process_run(routes, llama_checkpoint, tmp_path):
    folder, prompts, _ = routes
    result = run_ok(llama_checkpoint, prompts, "--out", tmp_path / "two.zarr", "--lens", "--lens-flush", "2",
                    "--workers", "2", "--memory-limit", "1GiB")
    assert "dask LocalCluster: 2 workers" in result.output
    store = open_store(tmp_path / "two.zarr")
    assert len(store) == len(LINES) and all(r.ok for r in store.verify())
    assert_same_lens(lenses.load_lens(folder / "lens.zarr"), lenses.load_lens(tmp_path / "two.zarr"))


@pytest.mark.parametrize(("options", "message"), [
    (("--lens", "--components", "attn"), "Expected --lens without --components"),
    (("--lens", "--keep", "rank:4"), "Expected --keep none (the default with --lens) or full with --lens"),
    (("--keep", "none"), "Expected --keep none with --lens only"),
    (("--lens", "--layers", "7"), "layer"),
])
def test_bad_lens_options_are_refused_before_any_store_is_written(llama_checkpoint, tmp_path, options, message):
    prompts = write_prompts(tmp_path / "p.txt", LINES[:1])
    result = invoke("run", llama_checkpoint, prompts, "--out", tmp_path / "new.zarr", *options)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "new.zarr").exists()


def test_lens_flush_must_be_positive(llama_checkpoint, tmp_path):
    result = invoke("run", llama_checkpoint, tmp_path / "p.txt", "--out", tmp_path / "n.zarr", "--lens",
                    "--lens-flush", "0")
    assert result.exit_code == 2 and "--lens-flush" in result.output


def test_lens_on_a_store_without_it_and_the_other_way_round_are_refused(routes, llama_checkpoint, tmp_path):
    folder, prompts, _ = routes
    plain = tmp_path / "plain.zarr"
    run_ok(llama_checkpoint, write_prompts(tmp_path / "one.txt", LINES[:1]), "--out", plain)
    for out, options, message in [
            (plain, ("--lens",), "Expected a store written with --lens to resume. Got"),
            (folder / "lens.zarr", (), "Expected a store written without --lens to resume. Got"),
            (folder / "lens.zarr", ("--lens", "--layers", "0"), "Expected the lens layers of the store")]:
        before = store_snapshot(out)
        result = invoke("run", llama_checkpoint, prompts, "--out", out, *options)
        assert result.exit_code == 1 and message in result.output, result.output
        assert store_snapshot(out) == before


def test_an_encoder_cannot_give_a_lens(tmp_path):
    from detjac.engine.checkpoints.tiny import save_tiny_checkpoint

    bert = save_tiny_checkpoint(tmp_path / "tiny-bert", "bert")
    result = invoke("run", bert, write_prompts(tmp_path / "p.txt", LINES[:1]), "--out", tmp_path / "b.zarr", "--lens")
    assert result.exit_code == 1 and "for an encoder" in result.output and "to_output" in result.output
    assert not (tmp_path / "b.zarr").exists()
