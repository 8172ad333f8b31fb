"""The one output check (``detjac.outputs``): what it refuses, in one line, before anything is written; and the one
atomic writer. Torch-free, no model: folders and files made here."""

from __future__ import annotations

import os

import pytest

from detjac.errors import InvalidArgumentError
from detjac.outputs import FILE, FOLDER, STORE, check_output, write_folder, write_output, zarr_root


def _zarr_group(folder):
    folder.mkdir(parents=True)
    (folder / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    return folder


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("kind", [FILE, FOLDER, STORE])
def test_a_target_equal_to_inside_or_holding_what_is_read_is_refused(tmp_path, kind):
    read = tmp_path / "inputs" / "corpus.txt"
    read.parent.mkdir()
    read.write_text("a\n")
    reads = [("the corpus", read)]
    for target, how in ((read, "which is it"), (read.parent, "which holds it")):
        with pytest.raises(InvalidArgumentError, match=f"Expected an output outside the corpus .*corpus.txt, which "
                                                       f"this command reads. Got .*, {how}; nothing was written"):
            check_output(target, force=True, kind=kind, reads=reads)
    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(InvalidArgumentError, match="which is inside it"):
        check_output(folder / "out.json", kind=kind, reads=[("the model", folder)])
    assert check_output(tmp_path / "elsewhere", kind=kind, reads=reads) == tmp_path / "elsewhere"


def test_a_target_inside_any_zarr_group_is_refused_also_through_a_link(tmp_path):
    store = _zarr_group(tmp_path / "run.zarr")
    _zarr_group(store / "prompts" / "abc")
    assert zarr_root(store / "prompts" / "abc" / "x") == store and zarr_root(tmp_path) is None
    link = tmp_path / "here"
    link.symlink_to(store / "prompts", target_is_directory=True)
    for target in (store / "pages", store / "prompts" / "abc" / "g.json", link / "nidx.zarr"):
        for kind in (FILE, FOLDER, STORE):
            with pytest.raises(InvalidArgumentError, match=f"Got {target}, inside {store} \\(a zarr group"):
                check_output(target, kind=kind)
    assert _listing(tmp_path) == ["here", "run.zarr", "run.zarr/prompts", "run.zarr/prompts/abc",
                                  "run.zarr/prompts/abc/zarr.json", "run.zarr/zarr.json"]
    assert check_output(store, kind=STORE) == store  # a store itself is its own code's to resume


@pytest.mark.parametrize("kind", [FILE, FOLDER, STORE])
def test_a_missing_folder_and_a_link_are_refused_alike_for_every_kind(tmp_path, kind):
    with pytest.raises(InvalidArgumentError, match=f"Expected an existing folder for {tmp_path}/no/out. Got none at "
                                                   f"{tmp_path}/no."):
        check_output(tmp_path / "no" / "out", kind=kind)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for link in ("link", "dangling"):
        with pytest.raises(InvalidArgumentError, match=f"Got {tmp_path / link}, which is a link \\(links are never "
                                                       "followed or replaced\\); nothing was written"):
            check_output(tmp_path / link, force=True, kind=kind)
    assert not (tmp_path / "no").exists() and not (tmp_path / "nowhere").exists()


def test_files_need_their_suffix_and_force_and_folders_must_be_new_or_empty(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"^Expected a path ending in .json. Got '.*g.txt'.$"):
        check_output(tmp_path / "g.txt", suffix=".json")
    existing = tmp_path / "G.JSON"
    existing.write_text("{}")
    with pytest.raises(InvalidArgumentError, match="Expected a new file. Got .*G.JSON, which exists \\(--force"):
        check_output(existing, suffix=".json")
    assert check_output(existing, force=True, suffix=".json") == existing
    (tmp_path / "d.json").mkdir()
    with pytest.raises(InvalidArgumentError, match="Got a folder at .*d.json; nothing was written"):
        check_output(tmp_path / "d.json", force=True, suffix=".json")
    os.mkfifo(tmp_path / "f.json")
    with pytest.raises(InvalidArgumentError, match="Got something that is not a regular file at"):
        check_output(tmp_path / "f.json", force=True, suffix=".json")
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgumentError, match="Expected a new or empty folder. Got .*full, which is not empty"):
        check_output(full, kind=FOLDER)
    with pytest.raises(InvalidArgumentError, match="which is a file"):
        check_output(existing, kind=FOLDER)
    (tmp_path / "empty").mkdir()
    assert check_output(tmp_path / "empty", kind=FOLDER) == tmp_path / "empty"


def test_the_writer_replaces_whole_files_and_folders_and_leaves_nothing_when_interrupted(tmp_path):
    path = tmp_path / "a.json"
    assert write_output(path, "é") == path and path.read_bytes() == "é".encode()
    write_output(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"

    def killed(handle):
        handle.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_output(path, killed)
    assert path.read_bytes() == b"\x00\x01" and _listing(tmp_path) == ["a.json"]
    (tmp_path / "pages").mkdir()
    names = write_folder(tmp_path / "pages", lambda folder: (folder / "index.html").write_text("x") and ["index.html"])
    assert names == ["index.html"] and (tmp_path / "pages" / "index.html").read_text() == "x"

    def broken(folder):
        (folder / "index.html").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_folder(tmp_path / "other", broken)
    assert _listing(tmp_path) == ["a.json", "pages", "pages/index.html"]
