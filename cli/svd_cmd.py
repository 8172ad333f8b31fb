"""``detjac svd``: top singular triplets of one prompt's Jacobian from products, without forming it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from detjac.model_settings import LoadSpec
from detjac.sinks import sink_note

from .options import (
    check_out,
    model_argument,
    model_options,
    model_reads,
    out_option,
    prompt_options,
)

if TYPE_CHECKING:
    from detjac.engine import JacobianOperator, ModelRef
    from detjac.runs import SvdOutcome


@click.command("svd")
@model_argument()
@prompt_options()
@model_options()
@click.option("--k", "k", type=click.IntRange(min=1), default=16, show_default=True,
              help="Singular triplets wanted (more than jacobian's: a long prompt's leading subspace, which Lanczos "
                   "finds together).")
@click.option("--top", type=click.IntRange(min=1), default=6, show_default=True,
              help="Decoded tokens per singular vector.")
@click.option("--method", type=click.Choice(["lanczos", "randomized"]), default="lanczos", show_default=True,
              help="Block Lanczos, or randomized subspace iteration (slower on clustered spectra).")
@click.option("--block", type=click.IntRange(min=1), default=8, show_default=True,
              help="Lanczos: vectors added to the basis per iteration.")
@click.option("--oversample", type=click.IntRange(min=0), default=8, show_default=True,
              help="Randomized: extra subspace vectors beyond --k.")
@click.option("--tol", type=click.FloatRange(min=0, min_open=True, max=1, max_open=True), default=None,
              help="Residual ||J v - sigma u|| / sigma_1 at which a triplet has converged "
                   "[default: 1e-8 in float64, sqrt(eps) otherwise].")
@click.option("--max-iters", type=click.IntRange(min=1), default=None,
              help="Iteration limit [default: none for Lanczos (it ends by d_model/block iterations), "
                   "100 for randomized].")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random start.")
@click.option("--product-block", type=click.IntRange(min=1), default=None,
              help="Vectors per product sweep (memory) [default: 64, or what --max-memory allows].")
@click.option("--position", type=int, default=None,
              help="Target position [default: the last token; [CLS] (0) for encoders].")
@click.option("--compare", is_flag=True,
              help="Also form J with the row-block engine and compare with its full SVD (short prompts only).")
@out_option("Write U, S, V, the residuals and the token ids to this .npz file.",
            check=lambda out, force: _check_npz(out, force))
def svd(model: ModelRef, prompt: str, model_options: LoadSpec, k: int, top: int, method: str, block: int,
        oversample: int, tol: float | None, max_iters: int | None, seed: int, product_block: int | None,
        position: int | None, compare: bool, out: str | None, force: bool) -> None:
    """Top singular triplets of MODEL's detached Jacobian on one prompt, without forming it.

    The combined operator J = [J_1 ... J_n] (d_model x n_tokens * d_model) is applied by
    products only: J^T u by vmapped pullbacks and J v by the transposed pullback (or, with
    --streamed, by forward-mode sweeps through one layer at a time). Block Lanczos on J J^T
    finds the top --k triplets; each converges when ||J v - sigma u|| <= tol * sigma_1.
    Memory stays at one block of product vectors instead of the whole J (2 GiB in float64
    at d_model 512 and 1024 tokens).

    Prints the singular values with their residuals, the tokens the left vectors decode to
    (through the unembedding) and the right vectors (the token block carrying most of
    |v|^2, through the input embedding), and the products used.

    \b
    Examples:
      detjac svd -p "Kitten, n. A young" --k 8                     # the default model
      detjac svd meta-llama/Llama-3.2-1B --prompt-file long.txt --k 16 --top 8
      detjac svd Qwen/Qwen3-14B --prompt-file long.txt --max-memory cpu=16GiB --dtype float32
      detjac svd -p "Oak, n. (Bot.) Any tree" --compare --out oak.npz
      detjac svd gemma-3-270m-q4_k_m.gguf -p "The bridge out of Marin is the" --streamed   # a GGUF file
    """
    from detjac.runs import SvdSettings, prompt_svd

    if out is not None:
        out = _check_npz(out, force, model)  # before any work, now that MODEL is resolved: not into what it reads
    settings = SvdSettings(k=k, top=top, method=method, block=block, oversample=oversample, tol=tol,
                           max_iters=max_iters, seed=seed, product_block=product_block, position=position)
    o = model_options
    outcome = prompt_svd(o, prompt, settings, compare=compare, out=out, model_name=model.name,
                      log=lambda op: _echo_operator(model, o, op))
    op, result = outcome.op, outcome.result
    click.echo(f"reconstruction error of J x{' + b' if op.bias is not None else ''} (one product)  "
               f"{outcome.check_error:.3e}")
    status = "converged" if result.converged else f"NOT converged (tol {result.tol:.0e}: raise --max-iters)"
    click.echo(f"{method}: {result.iterations} iterations, basis {result.basis}, {result.matvecs} products with J "
               f"and {result.rmatvecs} with J^T in its iterations ({op.stats.products} in all with the check and the "
               f"final vectors, as the progress bar counts; {op.stats.sweeps} sweeps); {status}, max residual "
               f"{float(result.residuals.max()):.1e} sigma_1  ({outcome.seconds:.1f} s in all)")
    _echo_triplets(outcome)
    if outcome.compared is not None:
        taken, n_values, rel = outcome.compared
        click.echo(f"compare     formed J and its full SVD in {taken:.1f} s: max relative "
                   f"error of the top {n_values} singular values {rel:.1e}")
    if outcome.written is not None:
        click.echo(f"wrote U (d, k), S (k,), V (token, d, k) and residuals to {outcome.written}")


def _echo_operator(model: ModelRef, o: LoadSpec, op: JacobianOperator) -> None:
    n, d = op.n_tokens, op.d_model
    where = f"{o.device}, layers streamed one at a time" if o.streamed_engine else o.device
    click.echo(f"model       {model.name} ({o.dtype}, {where}); target: position {op.position} of {n} tokens")
    click.echo(f"operator    J = [J_1 ... J_n]: {d} x {n * d}, applied by products (never formed: "
               f"{d * n * d * op.dtype.itemsize / 2**20:.1f} MiB if it were)")


def _check_npz(out: str, force: bool, model: ModelRef | None = None) -> str:
    """``--out``: the .npz file it names (``.npz`` added to a name without it), checked; not into MODEL's files."""
    from detjac.store import npz_name

    return str(check_out(str(npz_name(out)), force=force, suffix=".npz", reads=model_reads(model)))


def _echo_triplets(outcome: SvdOutcome) -> None:
    from .render import piece, pieces

    tok, op = outcome.engine.tokenizer, outcome.op
    click.echo(f"  {'#':>3}  {'sigma':>10}  {'residual':>8}  left -> tokens | right [token, share of |v|^2] -> tokens")
    for i, t in enumerate(outcome.triplets):
        flag = sink_note(t.token, t.share, combined=op.n_tokens > 1)
        click.echo(f"  {i + 1:>3}  {t.sigma:>10.5g}  {t.residual:>8.1e}  {pieces(tok, t.left_ids)}"
                   f" | [{t.token} {piece(tok, op.token_ids[t.token])}, {t.share:.0%}{'; ' + flag if flag else ''}] "
                   f"{pieces(tok, t.right_ids)}")
