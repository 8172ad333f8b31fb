"""Layerwise analyses from the store: spectra against numpy, the logit lens, emergence of a planted token, heatmaps,
and the `detjac analyze layers|decode` commands, on synthetic stores (``detjac.store.testing``)."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from detjac.analysis import jobs, layers
from detjac.analysis.spectra import singular_values, stored_svd
from detjac.cli.main import main
from detjac.errors import InvalidArgumentError
from detjac.store import LayerwiseSpec, create_store, open_store
from detjac.store.testing import make_store

PROMPT = "the oak is a tree of the sea"
TARGETS = [f"{c}.{i}" for i in (0, 2, 3) for c in ("layer", "attn", "mlp", "mlp_local")]


P = "0" * 16  # a prompt id (16 hex digits)


@pytest.fixture(scope="module")
def layer_store(tmp_path_factory):
    """One prompt of 8 tokens, d = 16, four layers; targets of layers 0, 2 and 3 (``--layers 0,2,3 --components
    layer,attn,mlp,mlp_local``)."""
    return make_store(tmp_path_factory.mktemp("layers") / "lw.zarr", prompts=[PROMPT], d_model=16, n_layers=4,
                      targets=TARGETS).open()


def test_layerwise_spectra_match_numpy(layer_store):
    prompt = next(iter(layer_store))
    for target in ("layer.2", "mlp_local.3", "attn.0"):
        J = prompt.layerwise(target, lazy=False).astype(np.float64)
        A = J.reshape(J.shape[0], -1)
        exact = np.linalg.svd(A, compute_uv=False)
        spec = stored_svd(prompt, 4, method="gram", target=target)
        np.testing.assert_allclose(spec.S, exact[:4], rtol=1e-10)
        np.testing.assert_allclose(singular_values(prompt, target=target), exact, rtol=1e-10, atol=1e-12 * exact[0])
        assert np.all(spec.U.T @ prompt.layerwise(target, "output") >= 0)  # oriented along what it produced
        last = stored_svd(prompt, 2, -1, method="exact", target=target)
        np.testing.assert_allclose(last.S, np.linalg.svd(J[:, -1], compute_uv=False)[:2], rtol=1e-12)
        local = target.startswith("mlp_local")
        x = (prompt.layerwise(target, "inputs") if local else prompt.array("embeddings"))[-1]
        assert np.all(last.U.T @ (J[:, -1] @ x) >= 0)  # oriented along what token -1 alone produced


def test_lens_is_the_unembedding_after_the_final_norm_gain(layer_store, tmp_path):
    """``W_U diag(g)`` ranks tokens as ``W_U (g * h / rms(h))`` -- the model's decoding of a layer output ``h`` -- does
    (the same against the default model's lm_head is in tests/runs/test_layers_lens_run.py)."""
    W, has_gain = layers.lens(layer_store)
    gain, unembed = layer_store.model_array("final_norm"), layer_store.model_array("unembedding")
    assert has_gain and np.array_equal(W, unembed * gain)
    prompt = next(iter(layer_store))
    h = prompt.layerwise("layer.2", "output").astype(np.float64)
    logits = unembed @ (gain * h / np.sqrt(np.mean(h**2) + 1e-6))
    ours = W @ h
    assert np.corrcoef(ours, logits)[0, 1] > 1 - 1e-12  # the same up to the norm's positive scale
    assert np.array_equal(np.argsort(-ours, kind="stable"), np.argsort(-logits, kind="stable"))
    for t in np.argsort(-logits)[:5]:
        assert layers.token_rank(ours, int(t)) == layers.token_rank(logits, int(t))
    plain = make_store(tmp_path / "s.zarr", prompts=1, final_norm=False).open()
    W, has_gain = layers.lens(plain)
    assert not has_gain and np.array_equal(W, plain.model_array("unembedding"))


def _planted_store(path, planted_layer: int, token: int):
    """Targets layer.0..3 and mlp_local.1; only from ``planted_layer`` on does u_1 point at ``token``."""
    rng = np.random.default_rng(1)
    vocab, d, n = 50, 12, 3
    embed, lens, gain = rng.standard_normal((vocab, d)), rng.standard_normal((vocab, d)), rng.uniform(0.5, 2, d)
    lens /= np.linalg.norm(lens, axis=1, keepdims=True)  # rows of equal norm: lens @ lens[token] peaks at token
    unembed, u = lens / gain, lens[token]
    specs = {f"layer.{i}": LayerwiseSpec(i, "layer", False) for i in range(4)}
    specs["mlp_local.1"] = LayerwiseSpec(1, "mlp", True)
    run = {"model_id": "planted", "dtype": "float64", "keep": "full"}
    data = lambda: ({"embedding": embed, "unembedding": unembed, "final_norm": gain}, {})  # noqa: E731
    x = rng.standard_normal((n, d))
    with create_store(path, run, model_data=data) as st, \
            st.begin(P, n_rows=d, n_tokens=n, n_cols=d, dtype="float64", row_block=d, layerwise=specs) as w:
        J = rng.standard_normal((d, n, d))
        w.write_rows(0, d, J)
        for name, spec in specs.items():
            Jl = 0.01 * rng.standard_normal((d, n, d))
            if spec.layer >= planted_layer and not spec.local:
                Jl[:, 1, :] += 50 * np.outer(u, x[1])  # produces +u: u_1 keeps its orientation
            w.write_block(name, 0, d, 0, n, Jl)
            inputs = rng.standard_normal((n, d)) if spec.local else x
            if spec.local:
                w.write_layerwise(name, "inputs", inputs)
            w.write_layerwise(name, "output", np.einsum("rtc,tc->r", Jl, inputs))
        w.write_array("embeddings", x)
        w.write_array("output", np.einsum("rtc,tc->r", J, x))
        w.write_array("token_ids", np.arange(n))
        w.commit({"prompt": "planted", "n_tokens": n, "reconstruction_error": 0.0, "dtype": "float64",
                  "next_token_id": 7, "tokens": ["a", "b", "c"]})
    return open_store(path)


def test_emergence_finds_the_planted_layer(tmp_path):
    store = _planted_store(tmp_path / "s.zarr", planted_layer=2, token=31)
    rows = layers.layer_table(store, [P], k=2, top=1, token=31)
    by = {r["target"]: r for r in rows}
    assert [by[f"layer.{i}"]["u1_rank"] == 1 for i in range(4)] == [False, False, True, True]
    assert by["layer.3"]["first_sv"] == 1 and by["layer.0"]["first_sv"] == 0
    assert by["mlp_local.1"]["local"] and by["mlp_local.1"]["component"] == "mlp"
    (entry,) = [e for e in layers.emergence(rows) if e["component"] == "layer"]
    assert entry["first_layer_u1"] == 2 and entry["layers"] == 4
    assert store.read_analysis(P, "layers_layer.2")[1]["params"] == {"k": 2, "method": "gram"}
    heat = layers.token_heatmap(store, P, token=31)
    assert heat["layers"] == [0, 1, 2, 3] and heat["u1_rank"].shape == (4, 3)
    assert list(heat["u1_rank"][2:, 1]) == [1, 1] and heat["u1_rank"][0, 1] > 1
    prompt = store.get(P)
    Jl = prompt.layerwise("layer.3", lazy=False)
    contribution = Jl[:, 0] @ prompt.array("embeddings")[0]
    assert heat["contribution_rank"][3, 0] == layers.token_rank(layers.lens(store)[0] @ contribution, 31)
    local = layers.token_heatmap(store, P, "mlp", token=31, local=True)
    assert local["layers"] == [1] and local["component"] == "mlp_local"
    Jl, inputs = prompt.layerwise("mlp_local.1", lazy=False), prompt.layerwise("mlp_local.1", "inputs")
    assert list(local["contribution_rank"][0]) == [layers.token_rank(layers.lens(store)[0] @ (Jl[:, k] @ inputs[k]), 31)
                                                   for k in range(3)]
    with pytest.raises(InvalidArgumentError, match="Expected stored attn.L targets"):
        layers.token_heatmap(store, P, "attn")
    with pytest.raises(InvalidArgumentError, match="Expected layerwise targets"):
        layers.layer_table(store, [P], targets=["layer.9"])


@pytest.mark.slow  # ~15 s: dask's ProgressBar in the CLI waits up to 0.5 s after each compute
def test_layers_and_decode_commands(layer_store, tmp_path):
    import pyarrow.parquet as pq

    path, out = str(layer_store.path), tmp_path / "L"
    result = CliRunner().invoke(main, ["analyze", "layers", path, "--out", str(out), "--format", "parquet"])
    assert result.exit_code == 0, result.output
    table = pq.read_table(out / "layers.parquet").to_pylist()
    assert {r["target"] for r in table} == set(next(iter(layer_store)).layerwise_targets)
    assert all(r["token"] == next(iter(layer_store)).attrs["next_token_id"] for r in table)
    for name in ("layer_dims.png", "emergence.png", f"heatmap_{layer_store.prompt_ids()[0]}.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name
    assert "tracking" in result.output and "u_1 decoded" in result.output

    decoded = CliRunner().invoke(main, ["analyze", "decode", path, "--target", "layer.2", "--k", "2",
                                        "--plot", str(tmp_path / "d.svg"), "--table", str(tmp_path / "d.csv")])
    assert decoded.exit_code == 0, decoded.output
    assert (tmp_path / "d.svg").read_text().lstrip().startswith("<?xml")
    assert len((tmp_path / "d.csv").read_text().splitlines()) == 3 and "layer.2, [J_1 ... J_n]" in decoded.output
    pid = layer_store.prompt_ids()[0]
    assert layer_store.read_analysis(pid, "svd_layer.2_combined")[1]["target"] == "layer.2"

    bad = CliRunner().invoke(main, ["analyze", "layers", path, "--token", "Quercus oak", "--out", str(out)])
    assert bad.exit_code == 1 and "to be one token" in bad.output
    missing = CliRunner().invoke(main, ["analyze", "decode", path, "--target", "layer.1"])
    assert missing.exit_code == 1 and "Expected a layerwise target" in missing.output


def test_layers_refuses_a_store_without_layerwise_jacobians(tmp_path):
    make_store(tmp_path / "s.zarr", prompts=1)
    result = CliRunner().invoke(main, ["analyze", "layers", str(tmp_path / "s.zarr"), "--out", str(tmp_path / "L")])
    assert result.exit_code == 1 and "--layers all" in result.output


def test_report_includes_the_layerwise_section(layer_store, tmp_path):
    from detjac.analysis.report import analysis_report

    summary = analysis_report(layer_store, tmp_path / "R", top=10, table_format="parquet")
    assert summary["layerwise_prompts"] == 1 and 0 <= summary["prediction_emerges_in_u1"] <= 1
    assert {"layers.parquet", "emergence.parquet", "dims.parquet", "emergence.png"} <= set(summary["files"])
    assert jobs.token_id(layer_store, "id:5") == 5
    for text in ("id:²", "id:05"):  # a Unicode digit or a second way to write 5: refused by name, no ValueError
        with pytest.raises(InvalidArgumentError, match="Expected id:N with 0 <= N <"):
            jobs.token_id(layer_store, text)


def test_thin_svd_retries_the_transpose_when_lapack_does_not_converge(monkeypatch):
    from detjac.analysis import spectra

    A = np.random.default_rng(0).standard_normal((6, 4))
    real = np.linalg.svd

    def flaky(a, full_matrices=True, **kw):
        if a.shape == A.shape:
            raise np.linalg.LinAlgError("SVD did not converge")
        return real(a, full_matrices=full_matrices, **kw)

    monkeypatch.setattr(spectra.np.linalg, "svd", flaky)
    U, S, Vt = spectra.thin_svd(A)
    np.testing.assert_allclose(U * S @ Vt, A, atol=1e-12)
    np.testing.assert_allclose(S, real(A, compute_uv=False), rtol=1e-12)
