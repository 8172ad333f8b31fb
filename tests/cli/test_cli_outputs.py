"""Commands that read a model folder never write into it, and no command writes a store into another: ``--out``
inside the checkpoint folder MODEL, or inside a store, is refused by the one output check (``detjac.outputs``) before
the model loads, with nothing written."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.store.testing import make_store


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("command, name", [("jacobian", "j.npz"), ("graph", "g.json"), ("attention", "qk.json"),
                                           ("svd", "s.npz"), ("jacobian", "j.zarr")])
def test_an_output_inside_the_model_folder_it_reads_is_refused(llama_checkpoint, command, name):
    before = _listing(llama_checkpoint)
    extra = ["--layer", "0", "--head", "0"] if command == "attention" else []
    result = CliRunner().invoke(main, [command, str(llama_checkpoint), "-p", "a b", *extra,
                                       "--out", str(llama_checkpoint / name)])
    assert result.exit_code == 1, result.output
    assert (f"Expected an output outside the model {llama_checkpoint.resolve()}, which this command reads. Got "
            f"{llama_checkpoint / name}, which is inside it; nothing was written.") in result.output
    assert _listing(llama_checkpoint) == before


def test_a_store_written_inside_another_store_is_refused_and_the_store_still_verifies(tmp_path):
    store = make_store(tmp_path / "run.zarr", prompts=1).path
    before = _listing(store)
    (tmp_path / "p.txt").write_text("a b\n")
    for args in (["run", "default", str(tmp_path / "p.txt")], ["jacobian", "-p", "a b"]):
        result = CliRunner().invoke(main, [*args, "--out", str(store / "prompts" / "inner.zarr")])
        assert result.exit_code == 1 and (f"Expected an output outside any detjac store, neuron index or lens. Got "
                                          f"{store / 'prompts' / 'inner.zarr'}, inside {store} (a zarr group") \
            in result.output, result.output
    assert _listing(store) == before
    verified = CliRunner().invoke(main, ["store", "verify", str(store)])
    assert verified.exit_code == 0, verified.output


@pytest.mark.parametrize("args", [["analyze", "report", "{store}", "--out", "{store}/report"],
                                  ["analyze", "image", "{store}", "--out", "{store}/j.png"],
                                  ["analyze", "dims", "{store}", "--table", "{store}/dims.csv"]])
def test_tables_and_plots_of_an_analysis_are_refused_inside_the_store_it_reads(tmp_path, args):
    store = make_store(tmp_path / "run.zarr", prompts=1).path
    before = _listing(store)
    result = CliRunner().invoke(main, [a.format(store=store) for a in args])
    assert result.exit_code == 1 and f"Expected an output outside the store {store}, which this command reads. Got " \
        f"{args[-1].format(store=store)}, which is inside it; nothing was written." in result.output, result.output
    assert _listing(store) == before
