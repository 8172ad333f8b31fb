"""`detjac run` through the layer-streamed engine: layerwise Jacobians in the store, budgets, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from store_helpers import PROMPTS, write_prompts

from detjac.cli.main import main
from detjac.store import open_store, verify_prompt

COMPONENTS = "layer,attn,mlp,layer_local,attn_local,mlp_local"


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One prompt of the default model: in memory, streamed in reverse mode, and streamed in forward mode."""
    folder = tmp_path_factory.mktemp("streamed-run")
    prompts = write_prompts(folder / "p.txt", [PROMPTS[0][:12]])
    out = {}
    for name, extra in {"memory": [], "reverse": ["--layers", "all", "--components", COMPONENTS, "--mode", "reverse",
                                                  "--row-block", "100"],
                        "forward": ["--layers", "0,-1", "--mode", "forward"]}.items():
        result = invoke("run", "default", str(prompts), "--out", str(folder / f"{name}.zarr"), *extra)
        assert result.exit_code == 0, result.output
        out[name] = folder / f"{name}.zarr"
    return out


def _only(path: Path):
    store = open_store(path)
    assert len(store) == 1
    return store, store.get(store.prompt_ids()[0])


def test_streamed_store_holds_the_same_jacobian_and_every_layerwise_target(stores: dict[str, Path]) -> None:
    _, mem = _only(stores["memory"])
    store, rev = _only(stores["reverse"])
    assert store.run["engine"] == "streamed" and len(store.run["layerwise"]) == 6 * 4
    assert np.abs(rev.jacobian(lazy=False) - mem.jacobian(lazy=False)).max() <= 1e-12
    assert rev.attrs["next_token_id"] == mem.attrs["next_token_id"]
    for name in ("output", "embeddings", "token_ids"):
        np.testing.assert_allclose(rev.array(name), mem.array(name), rtol=0, atol=1e-12)
    assert rev.layerwise_targets == [f"{c}.{i}" for i in range(4) for c in sorted(COMPONENTS.split(","))]
    for target in rev.layerwise_targets:
        info = rev.layerwise_info(target)
        assert info["reconstruction_error"] < 1e-12 and info["mode"] == "reverse", target
        J = rev.layerwise(target, lazy=False)
        x = rev.layerwise(target, "inputs") if info["local"] else rev.array("embeddings")
        y = rev.layerwise(target, "output")
        assert J.shape == (256, len(x), 256)
        assert np.linalg.norm(np.einsum("rtc,tc->r", J, x) - y) / np.linalg.norm(y) < 1e-12
    # the residual stream decomposes in the store too: layer.3 = layer.2 + attn.3 + mlp.3
    parts = [rev.layerwise(t, lazy=False) for t in ("layer.2", "attn.3", "mlp.3")]
    assert np.abs(sum(parts) - rev.layerwise("layer.3", lazy=False)).max() < 1e-10
    # the last layer's output, normed, is the final Jacobian's input side: same next token
    assert verify_prompt(stores["reverse"] / "prompts" / rev.id).ok


def test_forward_mode_store_equals_reverse_mode(stores: dict[str, Path]) -> None:
    _, rev = _only(stores["reverse"])
    store, fwd = _only(stores["forward"])
    assert fwd.layerwise_targets == ["layer.0", "layer.3"] and store.run["mode"] == "forward"
    for target in fwd.layerwise_targets:
        assert fwd.layerwise_info(target)["mode"] == "forward"
        a, b = fwd.layerwise(target, lazy=False), rev.layerwise(target, lazy=False)
        assert np.abs(a - b).max() <= 1e-12 * max(1.0, np.abs(b).max())
    assert np.abs(fwd.jacobian(lazy=False) - rev.jacobian(lazy=False)).max() <= 1e-12
    assert verify_prompt(stores["forward"] / "prompts" / fwd.id).ok


def test_verify_catches_a_wrong_layerwise_value(stores: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    import zarr

    copy = tmp_path / "copy.zarr"
    shutil.copytree(stores["forward"], copy)
    _, prompt = _only(copy)
    arr = zarr.open_array(str(copy / "prompts" / prompt.id / "layerwise" / "layer.3" / "output"), mode="r+")
    arr[0] = arr[0] + 1.0
    result = verify_prompt(copy / "prompts" / prompt.id)
    assert not result.ok and "layer.3" in result.reason


def test_budgeted_and_low_rank_streamed_runs(tmp_path: Path, stores: dict[str, Path]) -> None:
    import zarr

    prompts = write_prompts(tmp_path / "p.txt", [PROMPTS[0][:12]])
    result = invoke("run", "default", str(prompts), "--out", str(tmp_path / "b.zarr"), "--max-memory", "cpu=40MiB")
    assert result.exit_code == 0, result.output
    store, budgeted = _only(tmp_path / "b.zarr")
    _, mem = _only(stores["memory"])
    assert np.abs(budgeted.jacobian(lazy=False) - mem.jacobian(lazy=False)).max() <= 1e-12
    assert store.run["row_block"] == "auto" and budgeted.attrs["stream"]["row_block"] < 256
    stored = zarr.open_array(str(tmp_path / "b.zarr" / "prompts" / budgeted.id / "jacobian"), mode="r")
    row_bytes = stored.shape[1] * stored.shape[2] * stored.dtype.itemsize  # shards within 1/64 of the budget
    assert stored.chunks[0] == budgeted.attrs["stream"]["row_block"]
    assert stored.shards[0] == stored.chunks[0] or stored.shards[0] * row_bytes <= (40 << 20) // 64
    result = invoke("run", "default", str(prompts), "--out", str(tmp_path / "r.zarr"), "--streamed", "--keep", "rank:4")
    assert result.exit_code == 0, result.output
    _, low = _only(tmp_path / "r.zarr")
    s_exact = np.linalg.svd(mem.jacobian(lazy=False).reshape(256, -1), compute_uv=False)[:4]
    np.testing.assert_allclose(low.triplets()[1], s_exact, rtol=1e-6)


@pytest.mark.parametrize("args,expected", [
    (["--components", "attn"], "Expected --layers with --components"),
    (["--layers", "0", "--keep", "rank:4"], "Expected --keep full with --layers"),
    (["--layers", "0", "--components", "attention"], "attention"),
    (["--layers", "7"], "7"),
    (["--mode", "forward"], "Expected --mode with the streamed engine"),
    (["--max-memory", "cpu=1MiB"], "raise --max-memory"),
    (["--max-memory", "gpu=lots"], "Expected --max-memory as DEVICE=SIZE"),
    (["--max-memory", "cuda:0=8GiB"], "Expected a memory budget for the compute device cpu" if torch.cuda.is_available()
     else "Expected a device this PyTorch can compute on (cpu). Got 'cuda:0'"),
])
def test_bad_streamed_options_are_refused_without_writing_a_prompt(tmp_path: Path, args: list[str],
                                                                    expected: str) -> None:
    prompts = write_prompts(tmp_path / "p.txt", [PROMPTS[0][:12]])
    result = invoke("run", "default", str(prompts), "--out", str(tmp_path / "s.zarr"), *args)
    assert result.exit_code != 0 and expected in result.output, result.output
    assert "Traceback" not in result.output
    if (tmp_path / "s.zarr").exists():
        assert len(open_store(tmp_path / "s.zarr")) == 0


def test_resuming_with_other_layerwise_targets_is_refused(tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.txt", [PROMPTS[0][:12]])
    assert invoke("run", "default", str(prompts), "--out", str(tmp_path / "s.zarr"), "--layers", "0").exit_code == 0
    result = invoke("run", "default", str(prompts), "--out", str(tmp_path / "s.zarr"), "--layers", "1")
    assert result.exit_code != 0 and "layerwise" in result.output
    again = invoke("run", "default", str(prompts), "--out", str(tmp_path / "s.zarr"), "--layers", "0")
    assert again.exit_code == 0 and "1 already in" in again.output
    info = invoke("store", "info", str(tmp_path / "s.zarr"), open_store(tmp_path / "s.zarr").prompt_ids()[0])
    assert info.exit_code == 0 and "layer.0" in info.output, info.output
    assert json.loads(json.dumps(open_store(tmp_path / "s.zarr").run))["layerwise"] == ["layer.0"]


# Whole `detjac run`s on the default model or a cluster: seconds each.
pytestmark = pytest.mark.slow
