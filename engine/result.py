"""What a Jacobian computation gives back: :class:`JacobianResult`, the one result type of
:func:`detjac.engine.jacobian`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from detjac.tokens import token_text


@dataclass(repr=False)
class JacobianResult:
    """A Jacobian of one forward pass and what it reconstructs.

    Attributes
    ----------
    jacobian : torch.Tensor
        (d_model, n_tokens, d_model): ``jacobian[:, k, :]`` is token ``k``'s operator ``J_k``.
    embeddings : torch.Tensor
        (n_tokens, d_model) input embeddings ``x_k``.
    output : torch.Tensor
        (d_model,) final normed hidden state at the target position.
    reconstruction : torch.Tensor
        (d_model,) ``sum_k J_k x_k`` (``+ b`` for an affine model).
    bias : torch.Tensor or None
        (d_model,) the offset ``b`` of an affine model's detached map, else None.
    reconstruction_error : float
        ``||reconstruction - output|| / ||output||``.
    logits, reconstruction_logits : torch.Tensor
        (vocab,) next-token logits from the output and from the reconstruction.
    tokens : list[str] or None
        Each token's text (:func:`detjac.tokens.token_text`), None without a tokenizer.
    tokenizer : Any
        The tokenizer that gave ``tokens`` (None without one): :attr:`next_token` decodes through it.
    """

    jacobian: torch.Tensor
    embeddings: torch.Tensor
    output: torch.Tensor
    reconstruction: torch.Tensor
    reconstruction_error: float
    token_ids: list[int]
    tokens: list[str] | None
    prompt: str | None
    position: int
    detached: bool
    family: str
    model_type: str
    dtype: torch.dtype
    row_block: int
    detach_rules: list[str]
    logits: torch.Tensor
    reconstruction_logits: torch.Tensor
    logit_jacobian: torch.Tensor | None = None
    logit_tokens: list[int] | None = None
    bias: torch.Tensor | None = None
    tokenizer: Any = field(default=None, compare=False)

    @property
    def next_token_id(self) -> int:
        """The model's predicted next token (argmax of its logits)."""
        return int(self.logits.argmax())

    @property
    def next_token(self) -> str | None:
        """The predicted next token's text (None without a tokenizer)."""
        return token_text(self.tokenizer, self.next_token_id) if self.tokenizer is not None else None

    def summary(self) -> dict[str, str]:
        """What the result is, in a few short fields (its repr and its Jupyter table)."""
        text = self.prompt if self.prompt is not None else f"token ids {self.token_ids[:8]}"
        return {"model": f"{self.model_type} ({self.family})",
                "prompt": repr(text[:60] + ("…" if len(text) > 60 else "")),
                "tokens": str(len(self.token_ids)),
                "jacobian": f"{tuple(self.jacobian.shape)} {str(self.dtype).removeprefix('torch.')}",
                "kind": "detached" if self.detached else "ordinary",
                "reconstruction error": f"{self.reconstruction_error:.2e}",
                "next token": (f"{self.next_token!r} (id {self.next_token_id})" if self.next_token is not None
                               else f"id {self.next_token_id}")}

    def __repr__(self) -> str:
        s = self.summary()
        return (f"<JacobianResult {s['model']}, {s['prompt']}: {s['tokens']} tokens, jacobian {s['jacobian']}, "
                f"{s['kind']}, reconstruction error {s['reconstruction error']}, next token {s['next token']}>")

    def _repr_html_(self) -> str:
        return html_table("JacobianResult", self.summary().items())

    @property
    def reconstructed_next_token_id(self) -> int:
        """The argmax of the logits computed from the reconstruction."""
        return int(self.reconstruction_logits.argmax())

    @property
    def produced(self) -> torch.Tensor:
        """(d_model,) what the operator produces, ``sum_k J_k x_k``: the output less an affine model's offset."""
        return self.output - self.bias if self.bias is not None else self.output

    def operator(self, k: int) -> torch.Tensor:
        """(d_model, d_model) operator ``J_k`` of token ``k``."""
        return self.jacobian[:, k, :]

    def summed(self) -> torch.Tensor:
        """(d_model, d_model) ``sum_k J_k``: the operator applied to a shared input direction."""
        return self.jacobian.sum(dim=1)

    def combined(self) -> torch.Tensor:
        """(d_model, n_tokens * d_model) ``[J_1 ... J_n]``, the operator on the stacked input."""
        return self.jacobian.reshape(self.jacobian.shape[0], -1)


def reconstruct(jacobian: torch.Tensor, embeddings: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_k J_k x_k (+ b)`` for J (rows, n, d), X (n, d) and an optional offset b (rows,); returns (rows,)."""
    recon = torch.einsum("rnd,nd->r", jacobian, embeddings)
    return recon + bias if bias is not None else recon


def html_table(title: str, rows: Any) -> str:
    """A small two-column HTML table (Jupyter's view of a result), every cell escaped."""
    from html import escape

    body = "".join(f"<tr><th style='text-align:left'>{escape(str(k))}</th><td style='text-align:left'>"
                   f"{escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table><caption style='text-align:left'><b>{escape(title)}</b></caption>{body}</table>"
