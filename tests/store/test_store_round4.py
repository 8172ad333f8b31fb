"""Metadata that lies: malformed JSON in the root or a prompt is one line, links that
leave the store are never read through, and a root claiming an older format than its contents is refused."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.errors import StoreFormatError
from detjac.store import open_store
from detjac.store.testing import make_store


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("round4") / "s.zarr", prompts=2)


@pytest.fixture
def store(pristine, tmp_path):
    path = tmp_path / "s.zarr"
    shutil.copytree(pristine.path, path)
    return path


COMMANDS = [("store", "ls"), ("store", "info"), ("analyze", "svd")]


@pytest.mark.parametrize(("text", "got"), [("[]", "Got a list."), ('{"zarr_format": 3, "attributes": 1}',
                                                                    "Got a number as its attributes."),
                                           ("[" * 100_000 + "]" * 100_000, "Got values nested too deep to read.")])
def test_malformed_root_json_is_one_line_in_every_command(store, text, got):
    (store / "zarr.json").write_text(text)
    with pytest.raises(StoreFormatError, match=got.replace(".", r"\.")):
        open_store(store)
    for command in COMMANDS:
        result = invoke(*command, store)
        assert result.exit_code == 1 and got in result.output and "Traceback" not in result.output, result.output


def test_a_prompt_s_json_nested_too_deep_is_a_damaged_prompt(store):
    pid = open_store(store).prompt_ids()[0]
    (store / "prompts" / pid / "zarr.json").write_text('{"attributes": ' + "[" * 100_000 + "]" * 100_000 + "}")
    result = invoke("analyze", "svd", store, "--prompt-id", pid)
    assert result.exit_code == 1 and "values nested too deep to read" in result.output, result.output
    assert "Traceback" not in result.output


def _as_written_before_metadata_digests(store) -> None:
    """Drop the root's model metadata digests (stores written before they were recorded), resealing the root."""
    from detjac.store.integrity import INTEGRITY, attrs_digest

    meta = json.loads((store / "zarr.json").read_text())
    root = meta["attributes"]["detjac_store"]
    del root["model_metadata_sha256"]
    root[INTEGRITY] = {"attrs_sha256": attrs_digest(root)}
    (store / "zarr.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("recorded", [True, False])
def test_a_model_zarr_json_linked_outside_the_store_is_never_read(store, tmp_path, recorded):
    if not recorded:
        _as_written_before_metadata_digests(store)
    meta = store / "model" / "embedding" / "zarr.json"
    outside = tmp_path / "outside.json"
    shutil.copy(meta, outside)
    meta.unlink()
    os.symlink(outside, meta)
    result = invoke("analyze", "svd", store)  # decodes its singular vectors with the model's embedding
    assert result.exit_code == 1 and "Expected no symlinks inside the store" in result.output, result.output
    assert "sigma" not in result.output


def test_a_prompt_folder_linked_outside_is_not_counted_ok_by_verify(store, tmp_path):
    pid = open_store(store).prompt_ids()[0]
    outside = tmp_path / "outside"
    shutil.move(store / "prompts" / pid, outside)
    os.symlink(outside, store / "prompts" / pid)
    result = invoke("store", "verify", store)
    assert result.exit_code == 1
    assert f"CORRUPT {pid}: a symlink to {outside}: detjac reads only inside the store" in result.output
    assert "2 of 2 prompts ok" not in result.output


def test_a_root_claiming_format_1_over_sealed_contents_is_refused(store):
    meta = json.loads((store / "zarr.json").read_text())
    meta["attributes"]["detjac_store"]["format_version"] = 1
    (store / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreFormatError, match=r"Expected a store of format version 1 .* Got the contents of version "
                                               r"2 or later"):
        open_store(store)
    for command in COMMANDS:
        result = invoke(*command, store)
        assert result.exit_code == 1 and "which would switch off the checks" in result.output, result.output
