"""Row-block Jacobians of the (detached) forward pass: :func:`stream_jacobian`.

One forward pass, then rows block by block (:class:`JacobianStream`), by the explicit pieces or vmapped
``torch.func.vjp``; an affine family's offset ``b`` comes from a replay on zero inputs
(:mod:`detjac.engine.detach.factors`). Details: docs/engine.md, "The row-block engine"."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from detjac.errors import InvalidArgumentError, LinearizationError
from detjac.exactness import FLOAT64_EXACTNESS_BOUND, relative_error

from ..checkpoints.loading import get_tokenizer, parse_prompt
from ..detach.factors import FactorTape
from ..detach.model import linearized
from ..families import family_for
from ..pieces.runner import chosen_sweeps
from ..products.logits import logit_jacobian, output_logits
from .model_pieces import FrozenModel, freeze_model


@dataclass(frozen=True)
class RowBlock:
    """Rows ``start:stop`` of the Jacobian: ``values`` has shape (stop - start, n_tokens, d_model)."""

    start: int
    stop: int
    values: torch.Tensor


@dataclass
class JacobianStream:
    """A forward pass whose Jacobian rows are produced lazily, block by block.

    Attributes
    ----------
    token_ids : list[int]
        Prompt token ids (n_tokens).
    embeddings : torch.Tensor
        (n_tokens, d_model) input embeddings the model consumed.
    output : torch.Tensor
        (d_model,) final normed hidden state at ``position``.
    row_block : int
        Rows per block.
    bias : torch.Tensor or None
        (d_model,) offset ``b`` of an affine model's detached map (None for linear families
        and for the ordinary Jacobian).
    frozen : FrozenModel or None
        The explicit sweeps' pieces (then ``pullback`` is None).
    fallback : str or None
        Why the explicit sweeps were asked for and not taken (an unknown piece), else None.
    """

    token_ids: list[int]
    embeddings: torch.Tensor
    output: torch.Tensor
    position: int
    row_block: int
    detached: bool
    family: str
    detach_rules: list[str]
    pullback: Any = field(repr=False)
    progress: bool = False
    bias: torch.Tensor | None = None
    frozen: FrozenModel | None = field(default=None, repr=False)
    fallback: str | None = None

    def reconstruct(self, jacobian: torch.Tensor) -> torch.Tensor:
        """``sum_k J_k x_k (+ b)`` for rows of the Jacobian (rows, n_tokens, d_model) -> (rows,)."""
        return reconstruct(jacobian, self.embeddings, self.bias)

    @property
    def n_rows(self) -> int:
        return int(self.output.shape[0])

    @property
    def n_blocks(self) -> int:
        return -(-self.n_rows // self.row_block)

    def __iter__(self) -> Iterator[RowBlock]:
        return self.rows(self.row_block, self.progress)

    def rows(self, row_block: int, progress: bool = False) -> Iterator[RowBlock]:
        """Every row of J, ``row_block`` at a time, from vmapped pullbacks of basis cotangents."""
        from detjac.progress import progress_bar

        eye = torch.eye(self.n_rows, dtype=self.output.dtype, device=self.output.device)
        starts = range(0, self.n_rows, row_block)
        for start in progress_bar(starts, progress, "row blocks", "block", total=-(-self.n_rows // row_block)):
            stop = min(start + row_block, self.n_rows)
            yield RowBlock(start, stop, self.pull(eye[start:stop]))

    def pull(self, cotangents: torch.Tensor) -> torch.Tensor:
        """``cotangents @ J`` for a block of output-space rows (rows, d_model) -> (rows, n_tokens, d_model).

        Basis rows give rows of J (what iterating the stream does); any other rows give products with
        ``J^T`` without forming J (:mod:`detjac.engine.products.linear_operator`).
        """
        # torch.func pullbacks build a graph of the backward itself (for higher-order
        # transforms) unless grad mode is off; that graph would keep every intermediate
        # cotangent of the block alive (3x the peak memory at d_model=512).
        if self.frozen is not None:
            return self.frozen.pull(cotangents)
        with torch.no_grad():
            return torch.func.vmap(self.pullback)(cotangents)[0]


def prompt_position(model: PreTrainedModel, prompt: str | Sequence[int] | torch.Tensor, position: int | None,
                    tokenizer: Any | None) -> tuple[list[int], int]:
    """The prompt's token ids and the target position (None: the family's default), checked.

    Raises
    ------
    PromptError
        Empty prompt, unknown token ids, or more tokens than the model's context.
    InvalidArgumentError
        ``position`` outside the prompt.
    """
    ids = parse_prompt(prompt, model, tokenizer)
    if position is None:
        position = family_for(model.config).default_position
    if not -len(ids) <= position < len(ids):
        raise InvalidArgumentError(f"Expected a position in [-{len(ids)}, {len(ids)}). Got {position} instead.")
    return ids, position


def stream_jacobian(
    model: PreTrainedModel,
    prompt: str | Sequence[int] | torch.Tensor,
    *,
    row_block: int = 64,
    detach: bool = True,
    position: int | None = None,
    tokenizer: Any | None = None,
    progress: bool = False,
    convention: str | None = None,
    sweeps: str | None = None,
    warn: bool = True,
) -> JacobianStream:
    """Run the forward pass and return a stream of Jacobian row blocks.

    Parameters
    ----------
    model
        A loaded causal LM of a supported family (see :func:`load_model`).
    prompt
        Text (tokenized with the model's tokenizer, special tokens added) or token ids.
    row_block
        Cotangent rows per vmapped pullback: memory grows linearly with it.
    detach
        Freeze the nonlinear factors (detached Jacobian) or not (ordinary Jacobian).
    position
        Token position whose output is the target. Default: the last (causal models), 0
        (the [CLS] token) for encoders.
    convention
        The family's detach convention (None: its default; see :func:`linearized`).
    sweeps
        ``"explicit"`` (the model's frozen pieces) or ``"autograd"`` (``torch.func.vjp``); default: the
        ``DETJAC_SWEEPS`` environment variable, else ``"explicit"``. The ordinary Jacobian is always autograd.
    warn
        Warn (``RuntimeWarning``) when the explicit sweeps fall back to ``torch.func``; the reason is kept in
        ``fallback`` either way.

    Raises
    ------
    PromptError
        Empty prompt, unknown token ids, or more tokens than the model's context.
    InvalidArgumentError
        ``row_block`` < 1, ``position`` outside the prompt, a convention the family lacks, or a bad ``sweeps``.
    UnsupportedModelError
        Unknown family or a module without a detach rule.
    """
    if not isinstance(row_block, int) or row_block < 1:
        raise InvalidArgumentError(f"Expected row_block to be a positive integer. Got {row_block!r} instead.")
    ids, position = prompt_position(model, prompt, position, tokenizer)
    explicit = detach and chosen_sweeps(sweeps) == "explicit"
    fallback = None
    with linearized(model, detach=detach, convention=convention) as lin:
        device = next(model.parameters()).device
        input_ids = torch.tensor([ids], device=device)
        embeddings = lin.decoder.get_input_embeddings()(input_ids)[0].detach()  # (n, d)
        rules = lin.family.describe(lin.convention) if detach else []
        if explicit:
            frozen, output, bias = freeze_model(lin, embeddings, position % len(ids))
            if not isinstance(frozen, str):
                return JacobianStream(ids, embeddings, output, position, row_block, detach, lin.family.name, rules,
                                      None, progress, bias, frozen)
            fallback = frozen
            if warn:
                warnings.warn(f"{lin.family.name} {fallback}; its sweeps go through torch.func (the autograd sweeps) "
                              "instead of explicit matmuls.", RuntimeWarning, stacklevel=2)

        affine = detach and lin.family.affine

        def target(x: torch.Tensor) -> torch.Tensor:  # (n, d) -> (d,)
            return lin.decoder(inputs_embeds=x[None], use_cache=False).last_hidden_state[0, position]

        def forward(x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            if not affine:  # a linear map: b = 0, nothing to record
                return target(x), ()
            tape = FactorTape()
            with tape.recording():
                y = target(x)
            with tape.replaying_factors():  # the factors of x, on zero inputs: only the offsets remain
                bias = target(torch.zeros_like(x))
            return y, (bias.detach(),)

        output, pullback, aux = torch.func.vjp(forward, embeddings, has_aux=True)
        bias = aux[0] if aux else None
    return JacobianStream(
        token_ids=ids, embeddings=embeddings, output=output.detach(), position=position,
        row_block=row_block, detached=detach, family=lin.family.name, detach_rules=rules, pullback=pullback,
        progress=progress, bias=bias, fallback=fallback,
    )


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

    @property
    def next_token_id(self) -> int:
        """The model's predicted next token (argmax of its logits)."""
        return int(self.logits.argmax())

    def summary(self) -> dict[str, str]:
        """What the result is, in a few short fields (its repr and its Jupyter table)."""
        text = self.prompt if self.prompt is not None else f"token ids {self.token_ids[:8]}"
        return {"model": f"{self.model_type} ({self.family})",
                "prompt": repr(text[:60] + ("…" if len(text) > 60 else "")),
                "tokens": str(len(self.token_ids)),
                "jacobian": f"{tuple(self.jacobian.shape)} {str(self.dtype).removeprefix('torch.')}",
                "kind": "detached" if self.detached else "ordinary",
                "reconstruction error": f"{self.reconstruction_error:.2e}",
                "next token": str(self.next_token_id)}

    def __repr__(self) -> str:
        s = self.summary()
        return (f"<JacobianResult {s['model']}, {s['prompt']}: {s['tokens']} tokens, jacobian {s['jacobian']}, "
                f"{s['kind']}, reconstruction error {s['reconstruction error']}, next token id {s['next token']}>")

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


def detached_jacobian(
    model: PreTrainedModel,
    prompt: str | Sequence[int] | torch.Tensor,
    *,
    row_block: int = 64,
    detach: bool = True,
    position: int | None = None,
    target: str = "hidden",
    logit_tokens: Sequence[int] | None = None,
    tokenizer: Any | None = None,
    check: bool = True,
    progress: bool = False,
) -> JacobianResult:
    """The detached (or ordinary) Jacobian of the final hidden state w.r.t. the input embeddings.

    Parameters
    ----------
    model
        A loaded causal LM of a supported family (see :func:`load_model`).
    prompt
        Text or token ids.
    row_block
        Rows per vmapped pullback; the result does not depend on it.
    detach
        ``True`` for the detached Jacobian ``J+`` (exact linear system), ``False`` for
        the ordinary Jacobian of the same computation.
    position
        Token position whose output is the target (default: the last; 0, [CLS], for encoders).
    target
        ``"hidden"`` (default) or ``"logits"``, which also fills ``logit_jacobian`` as
        ``W_U[logit_tokens] @ J`` (all tokens if ``logit_tokens`` is None).
    check
        For a detached float64 Jacobian, raise :class:`LinearizationError` if the
        reconstruction error exceeds ``FLOAT64_EXACTNESS_BOUND``: a nonlinearity that no
        rule froze makes the linear system wrong, and that must not pass silently.
    progress
        Show a progress bar over row blocks.

    Returns
    -------
    JacobianResult
        ``jacobian`` is (d_model, n_tokens, d_model).
    """
    if target not in ("hidden", "logits"):
        raise InvalidArgumentError(f"Expected target 'hidden' or 'logits'. Got {target!r} instead.")
    tok = tokenizer if tokenizer is not None else get_tokenizer(model)
    stream = stream_jacobian(model, prompt, row_block=row_block, detach=detach, position=position,
                             tokenizer=tok, progress=progress)
    n, d = stream.embeddings.shape
    jac = torch.empty(stream.n_rows, n, d, dtype=stream.output.dtype, device=stream.output.device)
    for block in stream:
        jac[block.start:block.stop] = block.values
    recon = stream.reconstruct(jac)
    err = relative_error(recon, stream.output)
    if check and detach and jac.dtype == torch.float64 and not err < FLOAT64_EXACTNESS_BOUND:
        raise LinearizationError(
            f"Expected the detached float64 Jacobian to reconstruct the output exactly (relative "
            f"error < {FLOAT64_EXACTNESS_BOUND:g}). Got {err:.3e}: a nonlinearity on the path escaped "
            f"the {stream.family} detach rules. Please report this model."
        )
    with torch.no_grad():
        logits, recon_logits = output_logits(model, torch.stack([stream.output, recon]))
    result = JacobianResult(
        jacobian=jac, embeddings=stream.embeddings, output=stream.output, reconstruction=recon,
        reconstruction_error=err, token_ids=stream.token_ids,
        tokens=tok.convert_ids_to_tokens(stream.token_ids) if tok is not None else None,
        prompt=prompt if isinstance(prompt, str) else None, position=stream.position,
        detached=detach, family=stream.family, model_type=model.config.model_type, dtype=jac.dtype,
        row_block=row_block, detach_rules=stream.detach_rules, logits=logits, reconstruction_logits=recon_logits,
        bias=stream.bias,
    )
    if target == "logits":
        result.logit_tokens = list(logit_tokens) if logit_tokens is not None else None
        result.logit_jacobian = logit_jacobian(model, result, logit_tokens)
    return result


def html_table(title: str, rows: Any) -> str:
    """A small two-column HTML table (Jupyter's view of a result), every cell escaped."""
    from html import escape

    body = "".join(f"<tr><th style='text-align:left'>{escape(str(k))}</th><td style='text-align:left'>"
                   f"{escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table><caption style='text-align:left'><b>{escape(title)}</b></caption>{body}</table>"
