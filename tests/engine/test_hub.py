"""Hub ids resolved from a Hugging Face cache fabricated in the hub's layout, offline (no test touches the network)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hub_cache import fabricate_hub_cache

from detjac.cli.main import main
from detjac.engine import jacobian, load_engine
from detjac.engine.checkpoints.default import DEFAULT_MODEL_DIR
from detjac.engine.checkpoints.hub import hub_cache_dir
from detjac.engine.checkpoints.loading import check_checkpoint_dir
from detjac.errors import CheckpointError
from detjac.model_names import is_hub_id

REPO = "detjac-test/gcide-llama"
PROMPT = "Oak, n. A tree"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline hub cache holding the default model as REPO; returns its snapshot folder."""
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return fabricate_hub_cache(cache, REPO, DEFAULT_MODEL_DIR)


def test_cache_folder_follows_the_hub_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "direct"))
    assert hub_cache_dir() == tmp_path / "direct"


def test_hub_ids_are_told_from_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_hub_id("meta-llama/Llama-3.2-1B") and is_hub_id("Qwen/Qwen3-8B")
    for not_id in ("default", "./Llama-3.2-1B", "/abs/path", "a/b/c", "org/..", "org/-x", "org--x/y"):
        assert not is_hub_id(not_id), not_id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # an existing folder wins


def test_snapshot_is_found_by_id_branch_and_commit(hub: Path) -> None:
    assert check_checkpoint_dir(REPO) == hub
    assert check_checkpoint_dir(REPO, revision=hub.name) == hub  # a commit hash
    assert (hub / "model.safetensors").is_symlink()  # laid out as the hub lays it out


def test_hub_id_gives_the_same_jacobian_bit_for_bit(hub: Path) -> None:
    for streamed in (False, True):
        from_folder = load_engine(DEFAULT_MODEL_DIR, streamed=streamed)
        from_hub = load_engine(REPO, streamed=streamed)
        a, b = jacobian(from_folder, PROMPT), jacobian(from_hub, PROMPT)
        assert a.token_ids == b.token_ids  # the tokenizer comes from the snapshot too
        assert torch.equal(a.jacobian, b.jacobian), f"streamed={streamed}"


def test_missing_id_or_revision_names_the_fetch_command(hub: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        check_checkpoint_dir("nobody/missing-model")
    text = str(err.value)
    assert "'nobody/missing-model'" in text and "'main'" in text and str(hub_cache_dir()) in text
    assert "hf download nobody/missing-model --revision main" in text and "HF_HUB_OFFLINE" in text
    with pytest.raises(CheckpointError, match=f"hf download {REPO} --revision v2"):
        check_checkpoint_dir(REPO, revision="v2")


def test_a_revision_or_a_refs_file_never_leads_outside_the_cache(hub: Path, tmp_path: Path) -> None:
    from detjac.errors import InvalidArgumentError

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")  # what an escape would load
    with pytest.raises(InvalidArgumentError, match=r"Expected a revision of .* Got '\.\./\.\./\.\./outside'"):
        check_checkpoint_dir(REPO, revision="../../../outside")
    refs = hub.parent.parent / "refs"
    (refs / "evil").write_text("../../../../outside")  # the variant: a refs file that names a path
    with pytest.raises(CheckpointError, match=r"Expected a commit hash \(40 hexadecimal digits\) in .*evil\. Got "
                                              r"'\.\./\.\./\.\./\.\./outside'"):
        check_checkpoint_dir(REPO, revision="evil")
    assert check_checkpoint_dir(REPO) == hub  # main is untouched


def test_cli_takes_a_hub_id_and_explains_a_missing_one(hub: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(main, ["jacobian", REPO, "-p", PROMPT, "--k", "1", "--top", "1"])
    assert ok.exit_code == 0, ok.output
    assert f"model       {REPO}" in ok.output and "reconstruction error  detached" in ok.output
    missing = runner.invoke(main, ["jacobian", "nobody/missing-model", "-p", PROMPT])
    assert missing.exit_code == 1 and "Traceback" not in missing.output
    assert "hf download nobody/missing-model --revision main" in missing.output
