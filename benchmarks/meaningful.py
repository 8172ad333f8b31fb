"""Do the default model's singular vectors decode to its prediction? Measured on held-out prompts.

For every prompt in ``benchmarks/data/heldout_prompts.txt`` (prefixes of held-out dictionary
entries, written by ``scripts/train_default_model.py``; none is chosen by how the model does
on it) this computes the float64 detached Jacobian, the first left singular vector ``u_1``
of the combined operator ``[J_1 ... J_n]`` (sign fixed so ``u_1 . y >= 0`` for the output
``y``), decodes it through the unembedding and checks whether the model's predicted next
token is among the top ``--top`` tokens. Baselines: a random unit vector decoded the same
way (trained model's unembedding and prediction), and an untrained model of the same shape
and tokenizer (seeded initialisation) with its own prediction.

    .venv/bin/python -m benchmarks.meaningful            # ~5 minutes on 2 cores
    .venv/bin/python -m benchmarks.meaningful --limit 20 # quick look

Prints the table and writes it to ``benchmarks/results/meaningful.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from detjac.analysis.lens.lens_eval import wilson
from detjac.engine import InMemoryEngine, get_tokenizer, jacobian, load_model
from detjac.engine.checkpoints.default import default_model_dir
from detjac.engine.products.decode import decode_top, dense_svd

HERE = Path(__file__).resolve().parent


def leading_vector_hit(model, tokenizer, prompt: str, top: int) -> tuple[bool, int, int]:
    """(prediction in top-``top`` of decoded u_1, predicted id, rank of the prediction in the decode)."""
    res = jacobian(InMemoryEngine(model, tokenizer=tokenizer), prompt)
    svd = dense_svd(res.combined(), 1, orient=res.output)
    unembed = model.get_output_embeddings().weight.detach()
    ids, _ = decode_top(svd.U, unembed, unembed.shape[0])
    rank = int((ids[0] == res.next_token_id).nonzero()[0, 0]) + 1
    return rank <= top, res.next_token_id, rank


def random_vector_hit(model, predicted: int, gen: torch.Generator, top: int) -> bool:
    unembed = model.get_output_embeddings().weight.detach()
    vector = torch.randn(unembed.shape[1], 1, generator=gen, dtype=unembed.dtype)
    ids, _ = decode_top(vector / vector.norm(), unembed, top)
    return predicted in ids[0].tolist()


def untrained_like(model) -> torch.nn.Module:
    """Same config and tokenizer, seeded random initialisation (transformers' own init)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(model.config, dtype=torch.float64)
    return fresh.eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=Path, default=HERE / "data" / "heldout_prompts.txt")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--out", type=Path, default=HERE / "results" / "meaningful.json")
    args = p.parse_args()
    prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()][: args.limit]
    trained = load_model(default_model_dir(), dtype=torch.float64)
    tokenizer = get_tokenizer(trained)
    untrained = untrained_like(trained)
    gen = torch.Generator().manual_seed(0)
    counts = {"trained": 0, "random": 0, "untrained": 0}
    ranks = []
    started = time.time()
    for prompt in tqdm(prompts, desc="held-out prompts", unit="prompt"):
        hit, predicted, rank = leading_vector_hit(trained, tokenizer, prompt, args.top)
        counts["trained"] += hit
        ranks.append(rank)
        counts["random"] += random_vector_hit(trained, predicted, gen, args.top)
        counts["untrained"] += leading_vector_hit(untrained, tokenizer, prompt, args.top)[0]
    n = len(prompts)
    rows = {name: {"hits": c, "fraction": c / n, "ci95": wilson(c, n)} for name, c in counts.items()}
    labels = {"trained": "trained model, u_1 of [J_1 ... J_n]", "random": "random unit vector (trained W_U)",
              "untrained": "untrained model, u_1 of [J_1 ... J_n]"}
    print(f"\n{n} held-out prompts; predicted next token among the top-{args.top} decoded tokens:")
    for name, row in rows.items():
        lo, hi = row["ci95"]
        print(f"  {labels[name]:<40} {row['hits']:>4}/{n}  {row['fraction']:6.1%}  (95% CI {lo:.1%}-{hi:.1%})")
    median = sorted(ranks)[n // 2]
    print(f"  median rank of the prediction in u_1's decode (trained): {median} of {tokenizer.vocab_size}")
    result = {"prompts": n, "top": args.top, "rows": rows, "median_rank_trained": median,
              "vocab": len(tokenizer), "seconds": time.time() - started, "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
