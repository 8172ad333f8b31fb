"""The synthetic stores the store and analysis tests use are what their docstring promises: exact and consistent."""

from __future__ import annotations

import numpy as np
import pytest

from detjac.store.format import RUN_IDENTITY
from detjac.store.testing import layer_targets, make_store, prompt_texts, synthetic_model

ALL = "layer,attn,mlp,layer_local,attn_local,mlp_local"


def through(J, x):
    return np.einsum("rtc,tc->r", J, x)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("f") / "s.zarr", prompts=2, n_layers=3, targets=layer_targets(3, ALL))


def test_every_prompt_is_exact_and_its_layers_add_up(made):
    model = made.model
    assert set(RUN_IDENTITY) <= set(made.run) and made.run["layerwise"] == layer_targets(3, ALL)
    for truth in made.prompts.values():
        x = truth.embeddings
        assert np.array_equal(x, model.embedding[truth.token_ids])
        assert np.abs(through(truth.jacobian, x) - truth.output).max() < 1e-12
        lw = truth.layerwise
        previous = x[-1]
        for L in range(3):
            parts = lw[f"attn.{L}"].jacobian + lw[f"mlp.{L}"].jacobian
            base = lw[f"layer.{L - 1}"].jacobian if L else np.eye(8)[:, None, :] * (np.arange(4) == 3)[None, :, None]
            np.testing.assert_allclose(lw[f"layer.{L}"].jacobian, base + parts, atol=1e-14)
            for kind in ("layer", "attn", "mlp"):
                cumulative, local = lw[f"{kind}.{L}"], lw[f"{kind}_local.{L}"]
                np.testing.assert_allclose(through(cumulative.jacobian, x), cumulative.output, atol=1e-12)
                np.testing.assert_allclose(through(local.jacobian, local.inputs), cumulative.output, atol=1e-12)
                np.testing.assert_allclose(local.output, cumulative.output, atol=1e-12)
                np.testing.assert_allclose(local.inputs[-1], previous, atol=1e-12)
            previous = lw[f"layer.{L}"].output
        h = lw["layer.2"].output
        y = model.final_norm * h / np.sqrt(np.mean(h**2) + 1e-6)
        np.testing.assert_allclose(truth.output, y, atol=1e-12)
        assert truth.next_token_id == int(np.argmax(model.unembedding @ y))


def test_the_store_holds_the_truth_and_verifies(made):
    store = made.open()
    assert all(r.ok for r in store.verify())
    for pid, truth in made.prompts.items():
        prompt = store.get(pid)
        assert prompt.attrs["next_token"] == made.model.words[truth.next_token_id]
        assert prompt.attrs["tokens"] == [made.model.words[i] for i in truth.token_ids]
        assert set(prompt.attrs["layerwise"]) == set(truth.layerwise) and prompt.attrs["stream"]["row_block"] == 3
        assert np.array_equal(prompt.layerwise("mlp_local.1", "inputs"), truth.layerwise["mlp_local.1"].inputs)


def test_the_tokenizer_matches_the_token_ids(made):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(made.open().model_bytes("tokenizer.json").decode())
    for truth in made.prompts.values():
        assert tok.encode(truth.text).ids == truth.token_ids
    assert tok.encode("Quercus oak").ids == [0, made.model.words.index("oak")]  # unknown words: [UNK]


def test_ordinary_runs_do_not_reconstruct_and_settings_are_checked(tmp_path):
    model = synthetic_model(seed=4)
    texts = prompt_texts(2, 3, seed=4)
    det = make_store(tmp_path / "d.zarr", prompts=texts, model=model)
    ordinary = make_store(tmp_path / "o.zarr", prompts=texts, model=model, detach=False)
    assert ordinary.run["detach"] is False and ordinary.run["detach_rules"] == []
    for truth in ordinary.open():
        assert truth.attrs["reconstruction_error"] > 1e-2 and truth.attrs["detached"] is False
    by_text = {t.text: t for t in det.prompts.values()}
    for truth in ordinary.prompts.values():
        assert np.array_equal(by_text[truth.text].output, truth.output)  # the same model, the same outputs
    with pytest.raises(ValueError, match="Expected layerwise targets in full mode of a linear model"):
        make_store(tmp_path / "x.zarr", keep="rank:2", targets=["layer.0"])
    with pytest.raises(ValueError, match="Expected keep 'full' or 'rank:K'. Got 'rank:0'"):
        make_store(tmp_path / "y.zarr", keep="rank:0")
