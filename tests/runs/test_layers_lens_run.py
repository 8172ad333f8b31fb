"""`detjac run --layers` of the default model: the store's logit lens decodes a layer output as the model does.

Moved from tests/analysis/test_layers_analysis.py (the analyses themselves are tested there on synthetic stores).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from store_helpers import run_default

from detjac.analysis import layers

PROMPT = "Oak, n. (Bot.) Any tree"


@pytest.fixture(scope="module")
def layer_store(tmp_path_factory):
    return run_default(tmp_path_factory.mktemp("layers"), [PROMPT], "lw.zarr", "--layers", "0,2,3",
                       "--components", "layer,attn,mlp,mlp_local")


@pytest.mark.slow
def test_lens_decodes_a_layer_output_like_the_model(layer_store):
    """``W_U diag(g)`` ranks tokens exactly as lm_head(final_norm(h)) does for a stored layer output h."""
    from detjac.engine import load_model

    model = load_model("default")
    W, has_gain = layers.lens(layer_store)
    assert has_gain
    np.testing.assert_array_equal(layer_store.model_array("final_norm"), model.model.norm.weight.detach().numpy())
    prompt = next(iter(layer_store))
    h = prompt.layerwise("layer.2", "output").astype(np.float64)
    with torch.no_grad():
        logits = model.lm_head(model.model.norm(torch.from_numpy(h)[None])).numpy()[0]
    ours = W @ h
    assert np.corrcoef(ours, logits)[0, 1] > 1 - 1e-12  # the same up to the norm's positive scale
    assert np.array_equal(np.argsort(-ours)[:20], np.argsort(-logits)[:20])
    for t in np.argsort(-logits)[:5]:
        assert layers.token_rank(ours, int(t)) == layers.token_rank(logits, int(t))
