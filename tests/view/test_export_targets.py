"""Every writer a user reaches goes through the one output check (``detjac.outputs``): an export or an index written
into a neuron index or a Jacobian store is refused in one line with nothing written, and the index still opens and
the store still verifies; a missing folder and a link get the same answer from two different writers."""

from __future__ import annotations

import shutil

import numpy as np
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.store import open_neuron_index
from detjac.store.testing import make_store


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_an_export_into_the_neuron_index_it_reads_is_refused_and_the_index_still_opens(graph_file, neuron_index,
                                                                                      tmp_path):
    index = tmp_path / "n.zarr"
    shutil.copytree(neuron_index, index)  # the shared fixture stays read-only whatever happens here
    before = _listing(index)
    for target in (index / "index" / "pages", index / "pages"):
        result = _invoke("view", graph_file, "--neurons", index, "--export", target)
        assert result.exit_code == 1, result.output
        assert f"Expected an output outside the neuron index {index}, which this command reads. Got {target}, which " \
               "is inside it; nothing was written." in result.output
    assert _listing(index) == before
    assert open_neuron_index(index).shape == open_neuron_index(neuron_index).shape


def test_an_export_or_an_index_into_a_store_not_read_is_refused_and_the_store_still_verifies(graph_file, tmp_path):
    store = make_store(tmp_path / "run.zarr", prompts=1).path
    before = _listing(store)
    exported = _invoke("view", graph_file, "--export", store / "pages")
    (tmp_path / "corpus.txt").write_text("a b\n")
    indexed = _invoke("neurons", "default", tmp_path / "corpus.txt", "--out", store / "nidx.zarr")
    for result, target in ((exported, store / "pages"), (indexed, store / "nidx.zarr")):
        assert result.exit_code == 1 and (f"Expected an output outside any detjac store, neuron index or lens. Got "
                                          f"{target}, inside {store} (a zarr group") in result.output, result.output
    assert _listing(store) == before
    verified = _invoke("store", "verify", store)
    assert verified.exit_code == 0, verified.output


def test_a_missing_folder_and_a_link_get_one_answer_from_two_writers_and_force_replaces_a_file(tmp_path):
    made = make_store(tmp_path / "run.zarr", prompts=1)
    pid = made.ids[0]
    missing = tmp_path / "missing"
    npz = _invoke("store", "export", made.path, pid, "--out", missing / "x.npz")
    pages = _invoke("view", made.path, "--export", missing / "pages")
    for result, target in ((npz, missing / "x.npz"), (pages, missing / "pages")):
        assert result.exit_code == 1 and f"Expected an existing folder for {target}. Got none at {missing}." \
            in result.output, result.output
    assert not missing.exists()
    (tmp_path / "kept.npz").write_text("mine")
    (tmp_path / "link.npz").symlink_to(tmp_path / "kept.npz")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty", target_is_directory=True)
    npz = _invoke("store", "export", made.path, pid, "--out", tmp_path / "link.npz", "--force")
    pages = _invoke("view", made.path, "--export", tmp_path / "link")
    for result, target in ((npz, "link.npz"), (pages, "link")):
        assert result.exit_code == 1 and f"Got {tmp_path / target}, which is a link (links are never followed or " \
            "replaced); nothing was written." in result.output, result.output
    assert (tmp_path / "kept.npz").read_text() == "mine" and not any((tmp_path / "empty").iterdir())
    replaced = _invoke("store", "export", made.path, pid, "--out", tmp_path / "kept.npz", "--force")
    assert replaced.exit_code == 0, replaced.output
    assert np.array_equal(np.load(tmp_path / "kept.npz")["token_ids"], made.open().get(pid).array("token_ids"))


def test_an_index_built_from_python_into_a_store_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    import detjac.engine
    from detjac.errors import InvalidArgumentError
    from detjac.runs import NeuronOptions, build_neuron_index

    store = make_store(tmp_path / "run.zarr", prompts=1).path
    before = _listing(store)
    (tmp_path / "corpus.txt").write_text("a b\n")
    monkeypatch.setattr(detjac.engine, "load_engine", lambda spec: (_ for _ in ()).throw(AssertionError("loaded")))
    try:
        build_neuron_index("default", tmp_path / "corpus.txt", store / "nidx.zarr", NeuronOptions(top_k=2),
                           progress=False)
    except InvalidArgumentError as exc:
        assert f"inside {store} (a zarr group" in str(exc)
    else:
        raise AssertionError("an index inside a store was written")
    assert _listing(store) == before
