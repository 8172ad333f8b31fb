"""Everyday reading of a store: xarray sees named dimensions and token coordinates without warnings; store
objects print as what they hold."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from detjac.store.testing import layer_targets, make_store

xr = pytest.importorskip("xarray")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("x") / "s.zarr", prompts=2, n_tokens=5, n_layers=2,
                      targets=layer_targets(2, "layer"))


def test_open_zarr_on_a_prompt_has_token_coordinates_and_no_warning(made):
    store = made.open()
    for pid, truth in made.prompts.items():
        prompt = store.get(pid)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the consolidated-metadata warning would fail here
            ds = xr.open_zarr(prompt.path)
            same = prompt.to_xarray()
        assert ds.jacobian.dims == ("row", "token", "col") and ds.sizes["token"] == truth.n_tokens
        assert list(ds.token.values) == list(range(truth.n_tokens))
        assert list(ds.token_ids.values) == truth.token_ids and "token_ids" in ds.coords
        assert list(ds.token_text.values) == prompt.attrs["tokens"] and "token_text" in ds.coords
        np.testing.assert_array_equal(ds.jacobian.sel(token=1).values, truth.jacobian[:, 1])
        assert same.identical(ds)


def test_store_and_prompt_reprs_say_what_they_hold(made):
    store = made.open()
    text = repr(store)
    assert text.startswith("<ZarrStore ") and "2 prompts" in text and "model synthetic (synthetic)" in text
    assert "float64, full, 2 layerwise targets>" in text and " object at 0x" not in text
    prompt = store.get(made.ids[0])
    text = repr(prompt)
    assert text.startswith(f"<ZarrPrompt {prompt.id}: '{prompt.prompt[:20]}")
    assert "5 tokens, full, 2 layerwise, float64" in text and "error" in text and " object at 0x" not in text
