"""Synthetic stores, to test code that reads stores (like ``numpy.testing``): no torch, no model, exact by
construction. Import it explicitly (``from detjac.store.testing import make_store``); ``detjac.store`` does not.

:func:`make_store` writes a complete store through ``detjac.store``'s public API only
(``create_store``, ``begin``, ``write_rows`` / ``write_block`` / ``write_array`` /
``write_layerwise`` / ``write_triplets``, ``commit``), with the same arrays and attributes a
real ``detjac run`` writes (``runs/batch.py``, ``runs/plan.py``): the run description, the
model's ``embedding``, ``unembedding`` and ``final_norm`` and a ``tokenizer.json`` under
``model/``, and per prompt its Jacobian (or its low-rank triplets), embeddings, output, token
ids, an affine model's bias, and layerwise Jacobians.

The numbers come from a small random "model" that is exactly linear at each prompt, so
everything a store promises holds to rounding:

- the input embeddings are rows of the embedding matrix, ``x_k = E[token_k]``;
- layer ``L`` adds an attention and an MLP Jacobian (random) to the residual stream:
  ``layer.L = layer.(L-1) + attn.L + mlp.L``, with ``layer.(-1)`` the identity on the last
  token (docs/store-format.md), each target's ``output`` being ``sum_k J_k x_k``;
- the output is the final norm with its scale frozen: ``y = g * r * h`` for ``h`` the last
  layer's output, so ``J = diag(g r) layer.(n_layers-1)``, plus an offset ``b`` for an
  affine model; the next token is ``argmax(W_U y)``;
- a ``*_local.L`` target multiplies the hidden states entering layer ``L`` (``inputs``,
  the last of which is ``layer.(L-1)``'s output) and reconstructs the same output as its
  cumulative twin; ``layer_local.L = identity + attn_local.L + mlp_local.L``;
- a ``to_output.L`` target maps random layer states ``h_L`` (``input``, the last one ``layer.L``'s
  output) to the output ``y`` exactly: a random Jacobian corrected on the last token;
- an ordinary (``detach=False``) run's Jacobian is perturbed, so it does not reconstruct,
  and stores the error it has.

The truth (every array, in float64 before storage) is returned with the store, so tests
compare what the store and the analyses give back with independent numpy computations.
"""

from .graph import synthetic_graph
from .model import (
    EPS,
    UNK,
    WORDS,
    LayerwiseTruth,
    PromptTruth,
    SyntheticModel,
    factory_rank,
    layer_targets,
    prompt_texts,
    run_description,
    synthetic_model,
    synthetic_prompt,
)
from .write import SyntheticStore, make_store, write_prompt

__all__ = ["EPS", "UNK", "WORDS", "LayerwiseTruth", "PromptTruth", "SyntheticModel", "SyntheticStore", "factory_rank",
           "layer_targets", "make_store", "prompt_texts", "run_description", "synthetic_graph",
           "synthetic_model", "synthetic_prompt", "write_prompt"]
