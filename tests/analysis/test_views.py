"""The views of `detjac analyze columns|image|path` against numpy on a synthetic store, and the commands."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from detjac.analysis import layers, views
from detjac.cli.main import main
from detjac.errors import InvalidArgumentError
from detjac.singular import decode_top
from detjac.store.testing import make_store

TARGETS = [f"{c}.{i}" for i in range(4) for c in ("layer", "mlp_local")]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("views") / "v.zarr", prompts=["the oak is a tree of the sea"],
                      d_model=16, n_layers=4, targets=TARGETS).open()


def test_largest_columns_are_the_largest_decoded_and_signed(store):
    prompt = next(iter(store))
    for target in (None, "layer.2", "mlp_local.1"):
        rows = views.largest_columns(store, prompt.id, target=target, tokens=[0, -1], count=3, top=4)
        assert [r["token"] for r in rows] == [0] * 3 + [prompt.n_tokens - 1] * 3
        J = (prompt.jacobian(lazy=False) if target is None else prompt.layerwise(target, lazy=False)).astype(float)
        x = (prompt.array("embeddings") if target is None or "local" not in target
             else prompt.layerwise(target, "inputs")).astype(float)
        W = store.model_array("unembedding").astype(float) if target is None else layers.lens(store, target)[0]
        for k in (0, prompt.n_tokens - 1):
            Jk = J[:, k]
            norms = np.linalg.norm(Jk, axis=0)
            mine = [r for r in rows if r["token"] == k]
            assert [r["column"] for r in mine] == np.argsort(-norms, kind="stable")[:3].tolist()
            for r in mine:
                col = Jk[:, r["column"]]
                col = col if col @ (Jk @ x[k]) >= 0 else -col
                assert r["norm"] == pytest.approx(norms[r["column"]], rel=1e-12)
                assert r["decoded"] == decode_top(col[:, None], W, 4)[0][0].tolist()


def test_jacobian_image_is_the_stored_matrix(store):
    prompt = next(iter(store))
    image = views.jacobian_image(store, prompt.id, target="layer.1", token=-2)
    J = prompt.layerwise("layer.1", lazy=False)[:, -2].astype(float)
    assert image["token"] == prompt.n_tokens - 2 and np.array_equal(image["matrix"], J)
    np.testing.assert_allclose(image["singular_values"], np.linalg.svd(J, compute_uv=False), rtol=1e-12)
    # the stable rank ||J||_F^2 / sigma_1^2, from the one dimensionality function
    assert image["stable_rank"] == pytest.approx(np.linalg.norm(J) ** 2 / np.linalg.norm(J, 2) ** 2, rel=1e-12)


def test_singular_path_projects_each_layer_on_the_last(store):
    prompt = next(iter(store))
    data = views.singular_path(store, prompt.id, kind="layer", k=2)
    assert data["layers"] == [0, 1, 2, 3]
    np.testing.assert_allclose(data["projections"][-1], [1.0, 1.0], rtol=1e-10)
    U = []
    for layer in range(4):  # independent: numpy's SVD, each u oriented along what the layer produced
        J = prompt.layerwise(f"layer.{layer}", lazy=False).astype(float)
        u = np.linalg.svd(J.reshape(J.shape[0], -1))[0][:, :2]
        U.append(u * np.where(u.T @ prompt.layerwise(f"layer.{layer}", "output") < 0, -1.0, 1.0))
    expected = np.array([[U[i][:, j] @ U[-1][:, j] for j in range(2)] for i in range(4)])
    np.testing.assert_allclose(data["projections"], expected, atol=1e-8)
    for kind, message in (("mlp_local", "cumulative"), ("to_output", "cumulative"), ("ffn", "KIND"),
                          ("attn", "at least two layers")):
        with pytest.raises(InvalidArgumentError, match=message):
            views.singular_path(store, prompt.id, kind=kind)


def test_view_commands_write_their_figures(store, tmp_path):
    pid = store.prompt_ids()[0]
    for args, lines in ((["columns", "--token", "-1", "--count", "4"], 1 + 4), (["path", "--kind", "layer"], 1 + 4)):
        out = CliRunner().invoke(main, ["analyze", *args, str(store.path), "--out", str(tmp_path / args[0])])
        assert out.exit_code == 0, out.output
        assert len((tmp_path / args[0] / f"{args[0]}.csv").read_text().splitlines()) == lines
        assert (tmp_path / args[0] / f"{args[0]}.png").read_bytes()[:4] == b"\x89PNG"
    out = CliRunner().invoke(main, ["analyze", "image", str(store.path), "--prompt-id", pid, "--target", "mlp_local.2",
                                    "--out", str(tmp_path / "j.png")])
    assert out.exit_code == 0 and "mlp_local.2 J_" in out.output, out.output
    assert (tmp_path / "j.png").read_bytes()[:4] == b"\x89PNG"
    bad = CliRunner().invoke(main, ["analyze", "image", str(store.path), "--target", "attn.9"])
    assert bad.exit_code != 0 and "Expected a layerwise target" in bad.output and "Traceback" not in bad.output


def test_targets_after_the_final_norm_decode_through_the_unembedding_and_are_reported(store):
    W_U = store.model_array("unembedding").astype(float)
    g = store.model_array("final_norm").astype(float)
    for target in ("layer_normed.1", "mlp_normed_local.0", "to_output.2"):
        assert np.array_equal(layers.lens(store, target)[0], W_U)
    for target in ("layer.1", "resid_mid.0", "attn_local.3"):
        np.testing.assert_array_equal(layers.lens(store, target)[0], W_U * g)
    line = layers.targets_used([{"target": "layer.1", "normed": False}, {"target": "layer_normed.1", "normed": True},
                                {"target": "to_output.0", "normed": True}])
    assert line.startswith("targets: layer (residual stream before the final norm, decoded through W_U diag(g)); "
                           "layer_normed, to_output (after the final norm")
    rows = layers.layer_table(store, store.prompt_ids(), targets=["layer.0", "mlp_local.1"])
    assert [r["normed"] for r in rows] == [False, False]
