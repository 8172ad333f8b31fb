"""The lens on the default model: fitted from a real to_output store, applied and evaluated.

The exact per-prompt map must read the model's output at every layer (rank 1, error < 1e-12); at the last
layer the prompt's same-position block is the whole map (the final norm reads one position) and the logit
lens is the output itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from detjac.analysis import lens as lenses
from detjac.analysis.lens import lens_fit
from detjac.cli.main import main
from detjac.exactness import FLOAT64_EXACTNESS_BOUND
from tests.store_helpers import PROMPTS, run_default, write_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lens")
    store = run_default(folder, PROMPTS[:2], "fit.zarr", "--layers", "0,-1", "--components", "to_output",
                        "--row-block", "256")
    lens_fit.fit_lens(store)
    return folder, store


def test_the_exact_map_reads_the_output_and_the_lens_is_the_stored_mean(fitted):
    from detjac.engine import load_engine
    from detjac.runs.lens_apply import LENS_LOAD, check_lens_model, score_prompt, unembedding

    folder, store = fitted
    lens = lenses.load_lens(store.path)
    assert list(lens.layers) == [0, 3] and list(lens.count) == [2, 2]
    blocks = np.stack([np.asarray(p.layerwise("to_output.3")[:, -1, :]) for p in store])
    assert np.abs(lens.operator(3) - blocks.mean(axis=0)).max() < 1e-12
    engine = check_lens_model(load_engine("default", **LENS_LOAD), [lens])
    _, rows = score_prompt(engine, {"lens": lens}, PROMPTS[2], unembedding(engine), [0, 3])
    by = {(r["layer"], r["method"]): r for r in rows}
    for layer in (0, 3):
        assert by[layer, "exact"]["rank"] == 1 and by[layer, "exact"]["error"] < FLOAT64_EXACTNESS_BOUND
    assert by[3, "self"]["error"] < FLOAT64_EXACTNESS_BOUND and by[3, "logit"]["error"] < FLOAT64_EXACTNESS_BOUND
    assert by[0, "lens"]["error"] > 1e-3  # an average operator does not reproduce one prompt's output


def test_apply_and_evaluate_from_the_command_line(fitted, tmp_path):
    folder, store = fitted
    saved = tmp_path / "gcide.lens"
    assert CliRunner().invoke(main, ["lens", "save", str(store.path), str(saved)]).exit_code == 0
    out = CliRunner().invoke(main, ["lens", "apply", str(saved), "--prompt", PROMPTS[3], "--plot",
                                    str(tmp_path / "p.png")])
    assert out.exit_code == 0, out.output
    assert "detached lens" in out.output and "exact" in out.output and "model prediction" in out.output
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    prompts = write_prompts(tmp_path / "held.txt", PROMPTS[2:5])
    out = CliRunner().invoke(main, ["lens", "evaluate", str(saved), "--prompts", str(prompts), "--exact", "1",
                                    "--out", str(tmp_path / "eval")])
    assert out.exit_code == 0, out.output
    assert "| 3 | exact | 1 | 100.0 %" in out.output and "| 0 | detached lens | 3 |" in out.output
    assert (tmp_path / "eval" / "lens_agreement.png").is_file()


def test_a_lens_is_refused_on_other_weights_and_in_the_wrong_role(fitted, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from detjac.engine.checkpoints.default import resolve_model

    _, store = fitted
    saved = tmp_path / "gcide.lens"
    assert CliRunner().invoke(main, ["lens", "save", str(store.path), str(saved)]).exit_code == 0
    swapped = CliRunner().invoke(main, ["lens", "apply", str(saved), "--ordinary", str(saved), "--prompt", PROMPTS[3]])
    assert swapped.exit_code == 1 and "Expected the ordinary lens to be fitted on ordinary Jacobians. Got a lens " \
                                      "of detached Jacobians" in swapped.output
    other = shutil.copytree(resolve_model("default"), tmp_path / "perturbed")  # the same config, other weights
    (weights,) = other.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("mlp.up_proj.weight"))
    tensors[name][0, 0] += 0.25
    save_file(tensors, weights, metadata={"format": "pt"})
    refused = CliRunner().invoke(main, ["lens", "apply", str(saved), "--model", str(other), "--prompt", PROMPTS[3]])
    assert refused.exit_code == 1 and "another model, even if its config is the same" in refused.output


def test_a_lens_carries_its_model(fitted, tmp_path):
    """The lens records the model's layer count and where the model is, so `lens export` needs no
    --model (it was "Expected --model: the lens does not record the model's layer count") and `lens apply` defaults
    to the lens's own model, not to `default`."""
    import torch

    from detjac.engine import DEFAULT_MODEL_DIR
    from detjac.runs import read_lens, recorded_model

    _, store = fitted
    saved = tmp_path / "carried.lens"
    assert CliRunner().invoke(main, ["lens", "save", str(store.path), str(saved)]).exit_code == 0
    lens = read_lens(str(saved))
    assert lens.info["n_layers"] == 4 and recorded_model(lens) == str(DEFAULT_MODEL_DIR)
    out = CliRunner().invoke(main, ["lens", "export", str(saved), str(tmp_path / "c.pt")])
    assert out.exit_code == 0, out.output
    payload = torch.load(tmp_path / "c.pt", weights_only=True)
    assert payload["source_layers"] == [0]  # layers 0 and 3 fitted: the last of 4 is left out, as the format wants
    provenance = payload["metadata"]["detjac"]
    assert provenance["n_layers"] == 4 and provenance["model"]["model_path"] == str(DEFAULT_MODEL_DIR)
    assert read_lens(str(tmp_path / "c.pt")).info["n_layers"] == 4  # and the artifact carries it back
    gone = {**lens.info, "model": {**lens.info["model"], "model_path": str(tmp_path / "moved")}}
    assert recorded_model(type(lens)(lens.layers, lens.mean, lens.second_moment, lens.count, gone)) is None
