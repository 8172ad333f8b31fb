"""Logits and logit Jacobians from final hidden states, as the model computes them (soft-capping included).

An encoder without a language-model head (BERT) scores against its word embeddings instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from detjac.errors import UnsupportedModelError

from ..detach.activations import softcap_ratio
from ..families import family_for

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def decoding_matrix(model: PreTrainedModel) -> torch.Tensor:
    """(vocab, d_model) matrix that maps a final hidden state to token scores: the unembedding, or for an
    encoder without a language-model head (BERT), the word embeddings."""
    head = None if family_for(model.config).encoder else model.get_output_embeddings()
    return (head if head is not None else model.get_input_embeddings()).weight


def _final_softcap(model: PreTrainedModel) -> float | None:
    return getattr(model.config.get_text_config(), "final_logit_softcapping", None)


def output_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """Next-token logits (..., vocab) from final normed hidden states (..., d), as the model computes them.

    For an encoder without a language-model head these are scores against the word embeddings.
    """
    if family_for(model.config).encoder:
        weight = decoding_matrix(model)
        return hidden.to(weight.dtype) @ weight.T
    head = model.get_output_embeddings()
    logits = head(hidden.to(head.weight.dtype))
    cap = _final_softcap(model)
    if cap is not None:
        logits = logits * softcap_ratio(cap)(logits)
    return logits


def logit_jacobian(model: PreTrainedModel, result: Any, tokens: Sequence[int] | None = None) -> torch.Tensor:
    """Jacobian of chosen logits w.r.t. the input embeddings: ``W_U[tokens] @ J`` (``result``: a
    :class:`~detjac.engine.inmemory.rows.JacobianResult`).

    Never a vocabulary-sized pullback: the hidden-state Jacobian is mapped through the
    unembedding rows. With final-logit soft-capping ``c tanh(z / c)``, the capping is the
    scalar nonlinearity ``z * r(z)`` of :func:`detjac.engine.detach.activations.softcap_ratio`, whose
    ratio is frozen (detached) or differentiated (ordinary Jacobian).

    For an affine model the chosen logits are ``sum_k (W_U J_k) x_k + W_U b``: the offset
    ``W_U[tokens] @ result.bias`` is not part of the Jacobian.

    Returns
    -------
    (len(tokens), n_tokens, d_model); all vocabulary rows when ``tokens`` is None.
    """
    head = None if family_for(model.config).encoder else model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise UnsupportedModelError(
            "Expected a bias-free unembedding for a linear logit Jacobian. Got lm_head with a bias."
        )
    weight = decoding_matrix(model)
    rows = weight if tokens is None else weight[list(tokens)]  # (t, d)
    jac = torch.einsum("td,dnk->tnk", rows.to(result.jacobian.dtype), result.jacobian)
    cap = _final_softcap(model)
    if cap is not None:
        z = rows.to(result.output.dtype) @ result.output  # (t,)
        ratio = softcap_ratio(cap)
        if result.detached:
            factor = ratio(z)
        else:  # d/dz (z * r(z))
            factor = torch.func.vmap(torch.func.grad(lambda s: s * ratio(s)))(z)
        jac = jac * factor[:, None, None]
    return jac
