"""Row-block Jacobians of the (detached) forward pass: :func:`trace_model`.

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

from detjac.errors import InvalidArgumentError
from detjac.targets import DEFAULT_ROW_BLOCK, OUTPUTS

from ..checkpoints.loading import parse_prompt
from ..detach.factors import FactorTape
from ..detach.model import linearized
from ..families import family_for
from ..pieces import NotAPiece
from ..pieces.runner import chosen_sweeps
from ..result import reconstruct
from ..types import JacobianBlock
from .model_pieces import FrozenModel, freeze_model


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

    def __iter__(self) -> Iterator[JacobianBlock]:
        return self.rows(self.row_block, self.progress)

    def rows(self, row_block: int, progress: bool = False) -> Iterator[JacobianBlock]:
        """Every row of J, ``row_block`` at a time, from vmapped pullbacks of basis cotangents."""
        from detjac.progress import progress_bar

        eye = torch.eye(self.n_rows, dtype=self.output.dtype, device=self.output.device)
        starts = range(0, self.n_rows, row_block)
        for start in progress_bar(starts, progress, "row blocks", "block", total=-(-self.n_rows // row_block)):
            stop = min(start + row_block, self.n_rows)
            yield JacobianBlock(OUTPUTS, start, stop, 0, len(self.token_ids), self.pull(eye[start:stop]))

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


def trace_model(
    model: PreTrainedModel,
    prompt: str | Sequence[int] | torch.Tensor,
    *,
    row_block: int = DEFAULT_ROW_BLOCK,
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
            try:
                frozen, output, bias = freeze_model(lin, embeddings, position % len(ids))
            except NotAPiece as e:
                fallback = str(e)
            else:
                return JacobianStream(ids, embeddings, output, position, row_block, detach, lin.family.name, rules,
                                      None, progress, bias, frozen)
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
