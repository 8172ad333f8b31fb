"""``detjac run``: every prompt of a file into a store, in this process or on a dask.distributed cluster.

The run itself is :func:`detjac.runs.run.run_corpus`; this module parses, calls it and prints.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import click

from detjac.model_settings import LoadSpec

from . import render
from .graph_options import graph_options
from .options import (
    ROW_BLOCK_HELP,
    check_out,
    check_prompts,
    cluster_options,
    collect_model_options,
    corpus_options,
    force_new_option,
    model_argument,
    model_option,
    model_reads,
)

if TYPE_CHECKING:
    from detjac.engine import ModelRef
    from detjac.runs import ClusterOptions


@click.command()
@collect_model_options
@model_argument(required=True)
@click.argument("prompts", type=click.Path(), callback=check_prompts)
@click.option("--out", "-o", required=True,
              help="Store folder (created, or resumed): a path or a file:// URL; with --scheduler, on a file system "
                   "every worker mounts at the same path.")
@corpus_options(what="PROMPTS", long_prompts="; with --workers or --scheduler they are recorded as failed "
                                              "instead and the others run")
@model_option("dtype", help="Compute dtype; bfloat16 results are stored as float32.")
@click.option("--row-block", type=click.IntRange(min=1), default=None,
              help=f"{ROW_BLOCK_HELP} Also the rows per stored chunk.")
@click.option("--keep", default=None,
              help="full: the whole Jacobian; rank:K: only the top-K singular triplets of each token's J_k and of "
                   "[J_1 ... J_n], from a 3-pass subspace iteration over the streamed rows (the engine runs 3 times "
                   "per prompt; for long prompts or big models). A rank:K store gives `analyze svd` / `decode` (k at "
                   "most K) and `view`, not `analyze dims` / `report` (every singular value) nor the Jacobian itself. "
                   "none: no Jacobian (with --lens only). [default: full; none with --lens]")
@click.option("--ordinary", is_flag=True,
              help="Store the ordinary Jacobian (nothing detached; it does not reconstruct the output), "
                   "for comparison with the detached one.")
@click.option("--convention", default=None,
              help="The family's detach convention (default: its first). Phi3: up (default, like every family: "
                   "act(gate(x)) frozen, linear path through up) or gate (the paper's reference code: up(x) and "
                   "sigmoid(gate(x)) frozen, linear path through gate). Recorded in the store's run attributes.")
@click.option("--layers", default=None,
              help="Also store layerwise Jacobians of these layers: all, or indices like 0,5,10 (negative counts "
                   "from the end). Implies --streamed.")
@click.option("--components", default="layer", show_default=True,
              help="With --layers: layer (the layer's output), attn, mlp (its attention / MLP contributions), "
                   "resid_mid (the residual between them), layer_normed, attn_normed, mlp_normed (the paper's: "
                   "through the final norm frozen at the vector's own value), w.r.t. the input embeddings; add "
                   "_local (layer_local, mlp_normed_local, ...) for the same w.r.t. the layer's own input; "
                   "to_output: dy/dh_L, the output w.r.t. the layer's output at every position.")
@click.option("--lens", is_flag=True,
              help="Accumulate the detached Jacobian lens while running: per prompt and layer of --layers (default "
                   "all), the target position's block of dy/dh_L goes into running sums (flushed crash-safely with "
                   "the prompts they count) and no per-prompt operator is stored; lens/fitted is written at the "
                   "end (docs/lens.md). Implies --streamed.")
@click.option("--lens-flush", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --lens: write the sums every this many prompts (a kill costs at most that many prompts' "
                   "recomputation; each flush writes 2 x layers x d_model^2 float64 numbers).")
@graph_options("graph-", switch=(
    "Also store each prompt's exact attribution graph (nodes: tokens, MLP neurons, top logits), pruned as "
    "circuit-tracer prunes, as checksummed node and link tables (docs/graphs.md, \"In the store\"); a prompt is "
    "complete only with its graph. `detjac store export STORE ID --out g.json` writes its JSON, `detjac analyze "
    "graphs` finds the neurons that recur across prompts."))
@model_option("streamed",
              help="Use the layer-streamed engine: one decoder layer's weights in memory at a time, read from "
                   "the checkpoint (for models larger than memory). Implied by --layers, --max-memory, --quantize.")
@model_option("max_memory",
              help="Memory budget per device for the streamed engine, e.g. cpu=4GiB or cuda:0=8GiB,cpu=32GiB; "
                   "the row block is sized to fit.")
@click.option("--quantize", type=click.Choice(("nf4", "fp4", "int8")), default=None,
              help="Quantize a float checkpoint on load with bitsandbytes (pip install 'detjac[quant]'); the "
                   "Jacobian is that of the quantized model. bitsandbytes checkpoints are read as they are.")
@click.option("--mode", type=click.Choice(("auto", "reverse", "forward")), default="auto", show_default=True,
              help="Streamed engine: reverse (row blocks, vjp) or forward (token blocks, jvp) sweeps; auto picks "
                   "the cheaper by the cost model (see docs/engine.md, section Cost model).")
@force_new_option(replaces="a store written for another model or settings (kept aside until the new run stores a "
                           "prompt; put back if it stores none)")
@model_option("device",
              help="Torch device, e.g. cuda:0 (with --scheduler: each worker's own; dask-cuda gives each one GPU).")
@model_option("revision")
@model_option("trust_remote_code")
@model_option("gguf_file")
@cluster_options(memory_limit="auto", work="the prompts")
def run(model: ModelRef, prompts: str, out: str, model_options: LoadSpec, cluster: ClusterOptions,
        **settings: Any) -> None:
    """Detached Jacobians of MODEL on every prompt of PROMPTS, streamed into a store.

    PROMPTS is a .txt file (one prompt per line) or a .jsonl / .ndjson file ({"prompt": ...} or
    {"text": ...} per line, other fields kept as metadata); another name needs --prompts-format.
    Lines end at \\n (or \\r\\n) only; blank lines are skipped, a byte-order mark dropped (for one
    long prompt across lines, `detjac svd --prompt-file` reads a whole file as one). MODEL is a
    checkpoint folder, a hub id (org/name, from the Hugging Face cache), a GGUF file (exact for
    its weights as dequantized; the store records the file's SHA-256 and quantization types)
    or `default`. Each
    prompt's row blocks go to disk as they are computed and the prompt becomes visible only
    when complete. Re-running the same command after a crash or kill resumes: complete
    prompts are skipped, partial ones redone. Duplicate prompts are stored once.

    With --workers N or --scheduler ADDRESS the prompts go to dask.distributed workers: each
    loads the model once and commits its prompts into the same store, which ends equal to a
    run in one process (within float64 rounding: workers run their own thread counts). A
    prompt that cannot be run (too long, refused by the tokenizer, a failed exactness check)
    is recorded as failed in the store with its reason, and the others go on; a killed
    worker's prompt is redone by another worker; Ctrl-C stops cleanly and the same command
    resumes. Exit status: 0 every prompt stored, 3 some prompts failed (listed, and kept in
    the store) or a --lens run left prompts uncounted, 130 interrupted, 1 an error. A second
    run on a store that a run is writing is refused, naming its process and host.

    With --lens the run accumulates the detached Jacobian lens (the mean over prompts of
    dy_p/dh_{L,p}, p the last position) instead of storing operators: each prompt keeps its
    record, token ids, embeddings and output (and its Jacobian with --keep full), and the
    lens sums are written as sealed partials listing the prompts they count; a killed run
    resumes without losing or double-counting a prompt, --workers runs merge their sums, and
    the run ends by writing lens/fitted, which `detjac lens save/apply/evaluate` read.

    \b
    Examples:
      detjac run default prompts.txt --out run.zarr
      detjac run meta-llama/Llama-3.2-1B prompts.jsonl --out llama.zarr --dtype float32 --row-block 128
      detjac run default long_prompts.txt --out lowrank.zarr --keep rank:16
      detjac run default prompts.txt --out ordinary.zarr --ordinary
      detjac run default prompts.txt --out graphs.zarr --graph --graph-max-nodes 300
      detjac run default prompts.txt --out heads.zarr --graph --graph-max-nodes 300 --heads 50
      detjac run default prompts.txt --out layers.zarr --layers all --components layer,attn,mlp
      detjac run default prompts.txt --out lens.zarr --lens            # then: detjac lens save lens.zarr my.lens
      detjac run meta-llama/Llama-3.1-70B prompts.txt --out l70.zarr --lens --layers 20,40,60 --lens-flush 32 \\
          --dtype bfloat16 --device cuda:0 --quantize nf4
      detjac run Qwen/Qwen3-14B prompts.txt --out q.zarr --dtype bfloat16 --device cuda:0 --max-memory cuda:0=8GiB
      detjac run meta-llama/Llama-3.1-70B prompts.txt --out l.zarr --dtype bfloat16 --device cuda:0 --quantize nf4
      detjac run default prompts.txt --out run.zarr --workers 2
      detjac run SmolLM2-135M-Instruct.Q4_1.gguf prompts.txt --out smol.zarr --streamed --max-memory cpu=1GiB
      detjac run /shared/Qwen3-8B corpus.jsonl --out file:///shared/q8.zarr --scheduler tcp://10.0.0.5:8786 \\
          --dtype bfloat16 --device cuda:0
    """
    from detjac.runs import RunOptions, read_prompts, run_corpus

    check_out(out, kind="store", reads=[("the prompts file", prompts), *model_reads(model)])  # not inside a store
    load = replace(model_options, detach=not settings.pop("ordinary"), quantize=settings.pop("quantize"),
                   convention=settings.pop("convention"))
    prompts_format = settings.pop("prompts_format")
    source = read_prompts(prompts, prompts_format) if prompts_format else prompts
    options = RunOptions(load=load, cluster=cluster, **settings)
    outcome = run_corpus(model, source, out, options, log=click.echo)
    render.echo_run_outcome(outcome)
    if outcome.exit_code:
        sys.exit(outcome.exit_code)
