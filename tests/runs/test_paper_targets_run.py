"""`detjac run --components` with the paper's targets on the default model: stored, exact, verified, refused
cleanly when they cannot exist."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from store_helpers import PROMPTS, write_prompts

from detjac.cli.main import main
from detjac.store import open_store, verify_prompt

PAPER = "layer_normed,attn_normed,mlp_normed,resid_mid,to_output,layer_normed_local"


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("paper-run")
    prompts = write_prompts(folder / "p.txt", [PROMPTS[0][:12]])
    result = invoke("run", "default", str(prompts), "--out", str(folder / "s.zarr"), "--layers", "0,-1",
                    "--components", f"layer,{PAPER}", "--row-block", "128")
    assert result.exit_code == 0, result.output
    return folder / "s.zarr"


def test_paper_targets_are_stored_exact_and_verified(store: Path) -> None:
    s = open_store(store)
    p = s.get(s.prompt_ids()[0])
    expected = {f"{c}.{i}" for i in (0, 3) for c in ["layer", *PAPER.split(",")]}
    assert set(p.layerwise_targets) == expected == set(s.run["layerwise"])
    for target in p.layerwise_targets:
        info = p.layerwise_info(target)
        assert info["reconstruction_error"] < 1e-12, target
        source = "input" if target.startswith("to_output") else "inputs" if "_local" in target else None
        x = p.layerwise(target, source) if source else p.array("embeddings")
        y = p.layerwise(target, "output")
        J = p.layerwise(target, lazy=False)
        assert J.shape == (256, p.n_tokens, 256)
        assert np.linalg.norm(np.einsum("rtc,tc->r", J, x) - y) / np.linalg.norm(y) < 1e-12, target
    # to_output.L maps h_L (every position) to the model output y
    np.testing.assert_allclose(p.layerwise("to_output.3", "output"), p.array("output"), rtol=0, atol=1e-12)
    assert p.layerwise("to_output.0", "input").shape == (p.n_tokens, 256)
    # normed = diag(g / rms(h)) times un-normed, with g the stored final-norm gain
    h = p.layerwise("layer.3", "output")
    g = s.model_array("final_norm")
    scale = g / np.sqrt(np.mean(h**2) + 1e-5)
    np.testing.assert_allclose(p.layerwise("layer_normed.3", lazy=False),
                               scale[:, None, None] * p.layerwise("layer.3", lazy=False), rtol=1e-6, atol=1e-12)
    assert verify_prompt(store / "prompts" / p.id).ok


def test_verify_checks_to_output(store: Path, tmp_path: Path) -> None:
    import shutil

    import zarr

    copy = tmp_path / "copy.zarr"
    shutil.copytree(store, copy)
    pid = open_store(copy).prompt_ids()[0]
    arr = zarr.open_array(str(copy / "prompts" / pid / "layerwise" / "to_output.0" / "input"), mode="r+")
    arr[0] = arr[0] * 2.0
    result = verify_prompt(copy / "prompts" / pid)
    assert not result.ok and "to_output.0" in result.reason


def test_bad_components_are_refused_before_a_store_is_touched(tmp_path: Path) -> None:
    from detjac.engine.checkpoints.tiny import save_tiny_checkpoint

    prompts = write_prompts(tmp_path / "p.txt", [PROMPTS[0][:12]])
    result = invoke("run", "default", str(prompts), "--out", str(tmp_path / "a.zarr"), "--layers", "0",
                    "--components", "layer,to_output_local")
    assert result.exit_code != 0 and "to_output_local" in result.output and "layer_normed" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "a.zarr").exists()
    bert = save_tiny_checkpoint(tmp_path / "bert", "bert")
    result = invoke("run", str(bert), str(prompts), "--out", str(tmp_path / "b.zarr"), "--layers", "0",
                    "--components", "layer,to_output")
    assert result.exit_code != 0 and "encoder" in result.output and "to_output" in result.output, result.output
    assert "resid_mid" in result.output and "Traceback" not in result.output and not (tmp_path / "b.zarr").exists()


# A whole `detjac run` of the default model: seconds.
pytestmark = pytest.mark.slow
