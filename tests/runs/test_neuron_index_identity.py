"""A neuron index's identity and indexes: the corpus digest is over the parsed prompts (token ids are not their text),
the identity is sealed with the data and checked against the arrays (an edit of the root relabels nothing, an index
of the older format says how to rebuild it), every stored index is checked against what it indexes, a second writer
is refused by the lock kept beside the folder, and a graph of another model's shape is refused by name with or
without a weights digest."""

from __future__ import annotations

import fcntl
import json

import numpy as np
import pytest
from click.testing import CliRunner
from neuron_helpers import resealed
from store_helpers import write_prompts

from detjac.cli.main import main
from detjac.errors import StoreError
from detjac.runs import NeuronOptions, build_neuron_index
from detjac.store import NeuronIndexMismatch, open_neuron_index

PROMPTS = ["The capital of France is", "Kitten, n. A young cat"]
OPTIONS = NeuronOptions(top_k=2, shard_prompts=1)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("neuron-identity")
    prompts = write_prompts(folder / "p.txt", PROMPTS)
    build_neuron_index("default", prompts, folder / "n.zarr", OPTIONS, progress=False)
    return prompts, folder / "n.zarr"


def test_token_ids_and_a_text_line_of_them_are_two_corpora(built, tmp_path):
    _, out = built
    index = open_neuron_index(out)
    ids = [index.prompt_tokens(p).tolist() for p in range(len(PROMPTS))]
    jsonl = tmp_path / "ids.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": i}) + "\n" for i in ids))
    text = write_prompts(tmp_path / "ids.txt", [json.dumps(i) for i in ids])  # the same lines, read as text
    build_neuron_index("default", jsonl, tmp_path / "n.zarr", OPTIONS, progress=False)
    with pytest.raises(NeuronIndexMismatch, match="corpus_sha256"):
        build_neuron_index("default", text, tmp_path / "n.zarr", OPTIONS, progress=False)


def test_an_edited_root_relabels_nothing(built, tmp_path):
    import shutil

    _, out = built
    other = tmp_path / "other.zarr"
    shutil.copytree(out, other)
    meta = json.loads((other / "zarr.json").read_text())
    meta["attributes"]["identity"] = {"weights_sha256": "f" * 64, "n_layers": 30}
    (other / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="identity added to its root's attributes"):
        open_neuron_index(other)
    sealed = json.loads((out / "index" / "zarr.json").read_text())  # the identity's own place: under the seal
    sealed["attributes"]["identity"]["weights_sha256"] = "f" * 64
    shutil.copytree(out, tmp_path / "sealed.zarr")
    (tmp_path / "sealed.zarr" / "index" / "zarr.json").write_text(json.dumps(sealed))
    with pytest.raises(StoreError, match="Got a damaged one"):
        open_neuron_index(tmp_path / "sealed.zarr")


def test_an_identity_that_disagrees_with_the_arrays_is_refused(built, tmp_path):
    _, out = built
    lies = ({"neurons_per_layer": 1536}, {"n_layers": 30}, {"k": 5}, {"prompts": 7, "shard_prompts": 4})
    for n, identity in enumerate(lies):
        with pytest.raises(StoreError, match=r"of shape .* where its identity .* says"):
            open_neuron_index(resealed(out, tmp_path / f"i{n}.zarr", identity))


def test_an_index_of_the_older_format_says_how_to_rebuild_it(built, tmp_path):
    import shutil

    prompts, out = built
    old = tmp_path / "old.zarr"
    shutil.copytree(out, old)
    meta = json.loads((old / "zarr.json").read_text())
    identity = json.loads((old / "index" / "zarr.json").read_text())["attributes"]["identity"]
    meta["attributes"] = {"kind": "detjac-neuron-index", "format": 1, "identity": identity}
    (old / "zarr.json").write_text(json.dumps(meta))
    for run in (lambda: open_neuron_index(old), lambda: build_neuron_index("default", prompts, old, OPTIONS)):
        with pytest.raises(StoreError) as caught:
            run()
        message = str(caught.value)
        assert "format 1" in message and "--force-new" in message and "\n" not in message
    build_neuron_index("default", prompts, old, NeuronOptions(top_k=2, shard_prompts=1, force_new=True),
                       progress=False)
    assert open_neuron_index(old).identity == open_neuron_index(out).identity


@pytest.mark.parametrize(("name", "value", "said"), [
    ("top_position", -3, "top_position -3 outside its prompt"),
    ("top_position", 999, "top_position 999 outside its prompt"),
    ("top_prompt", 5, "top_prompt 5 outside -1..1"),
    ("top_prompt", -2, "top_prompt -2 outside"),
    ("prompt_offsets", -1, "prompt_offsets that are not offsets"),
    ("prompt_offsets", 10 ** 6, "prompt_offsets that are not offsets"),
])
def test_every_stored_index_is_checked_against_what_it_indexes(built, tmp_path, name, value, said):
    _, out = built
    arrays = open_neuron_index(out).arrays
    changed = arrays[name].copy()
    if name == "prompt_offsets":
        changed[1] = value
    else:
        slot = np.argwhere(arrays["top_prompt"] >= 0)[0]  # a filled slot of the first neuron
        changed[tuple(slot)] = value
    bad = resealed(out, tmp_path / "bad.zarr", arrays={name: changed})
    with pytest.raises(StoreError, match=said):
        open_neuron_index(bad)


def test_a_prompt_outside_the_corpus_is_refused_not_read_from_the_end(built):
    from detjac.errors import InvalidArgumentError

    index = open_neuron_index(built[1])
    last = index.arrays["prompt_tokens"][index.arrays["prompt_offsets"][1]:]
    assert index.prompt_tokens(np.int64(1)).tolist() == last.tolist() and last.size > 0
    for prompt in (-1, 2, True):
        with pytest.raises(InvalidArgumentError, match=f"Expected a prompt in 0..1 .* Got {prompt!r}"):
            index.prompt_tokens(prompt)


def test_a_second_writer_is_refused_by_the_lock_beside_the_index(built, tmp_path):
    import shutil

    prompts, out = built
    held = tmp_path / "n.zarr"
    shutil.copytree(out, held)
    before = {p.name: p.read_bytes() for p in (held / "index").rglob("*") if p.is_file()}
    with open(tmp_path / "n.zarr.lock", "a+") as lock:  # as a running `detjac neurons` holds it
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write(json.dumps({"pid": 4242, "host": "elsewhere", "since": "2026-11-29T08:00:00Z"}))
        lock.flush()
        result = CliRunner().invoke(main, ["neurons", "default", str(prompts), "--out", str(held), "--force-new",
                                           "-k", "3"])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
    message = result.output.strip()
    assert len(message.splitlines()) == 1, message
    assert "Expected no other writer" in message and "pid 4242 on host elsewhere" in message
    assert f"{tmp_path / 'n.zarr.lock'}" in message
    assert {p.name: p.read_bytes() for p in (held / "index").rglob("*") if p.is_file()} == before  # untouched


@pytest.fixture(scope="module")
def tiny_index(built, tmp_path_factory):
    """An index of a tiny random Llama: 3 layers of 48 neurons (the default model: 4 of 704)."""
    from detjac.engine.checkpoints.tiny import save_tiny_checkpoint

    folder = tmp_path_factory.mktemp("tiny-index")
    tiny = save_tiny_checkpoint(folder / "tiny", "llama")
    build_neuron_index(str(tiny), built[0], folder / "tiny.zarr", OPTIONS, progress=False)
    return folder / "tiny.zarr"


def test_graph_compares_the_models_shape_when_it_has_no_digest(tiny_index, tmp_path, monkeypatch):
    import detjac.runs.graph_run

    monkeypatch.setattr(detjac.runs.graph_run, "model_identity", lambda source: {})  # a model without files
    graph = tmp_path / "g.json"
    result = CliRunner().invoke(main, ["graph", "-p", "Paris", "--out", str(graph), "--max-nodes", "10",
                                       "--neurons", str(tiny_index)])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
    assert "n_layers: 3 (index) != 4; neurons_per_layer: 48 (index) != 704" in result.output, result.output
    assert not graph.exists()


def test_a_graph_of_another_models_shape_is_refused_without_a_digest(tiny_index, tmp_path):
    other = tiny_index
    graph = tmp_path / "g.json"
    result = CliRunner().invoke(main, ["graph", "-p", "Paris", "--out", str(graph), "--max-nodes", "10"])
    assert result.exit_code == 0, result.output
    data = json.loads(graph.read_text())
    info = data["metadata"]["info"]
    del info["weights_sha256"]  # as a graph written from Python may be
    graph.write_text(json.dumps(data))
    out = tmp_path / "pages"
    for said in ("n_layers: 3 (index) != 4; neurons_per_layer: 48 (index) != 704",  # compared by name
                 "Expected the graph's neurons inside the neuron index"):  # a graph that says nothing of its model
        result = CliRunner().invoke(main, ["view", str(graph), "--neurons", str(other), "--export", str(out)])
        assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
        message = result.output.strip()
        assert len(message.splitlines()) == 1 and said in message, message
        assert not out.exists()
        for key in ("family", "n_layers", "neurons_per_layer"):
            info.pop(key, None)
        graph.write_text(json.dumps(data))
