"""Train detjac's default model: a small Llama on the GCIDE dictionary (Debian ``dict-gcide``).

The recipe (the corpus, its held-out split, the prompts and the settings) is ``scripts/gcide.py``;
this runs it with torch. Deterministic (fixed seed, fixed thread count, deterministic kernels): a re-run on the
same corpus version, torch version and CPU reproduces the shipped weights; the script prints the SHA-256 of
``model.safetensors`` to compare with the model card. About 30 minutes on 2 cores.

Example::

    .venv/bin/python -m scripts.train_default_model                 # rebuild the shipped model
    .venv/bin/python -m scripts.train_default_model --steps 20 --out /tmp/smoke   # smoke run

Writes to ``--out``: the Hugging Face checkpoint (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``generation_config.json``, ...) and ``training.json`` (settings, loss,
perplexity, time). Also writes the loss curve PNG and the held-out prompts used by
``benchmarks/meaningful.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import gcide
from .gcide import CONTEXT, MODEL, N_PROMPTS, SEED, TRAIN, VOCAB, entry_prefixes, lr_at

ROOT = Path(__file__).resolve().parents[1]


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE trained on the training split; ``<s>`` is prepended to every encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=MODEL["max_position_embeddings"])


def pack(tokenizer, texts: list[str], context: int) -> torch.Tensor:
    """Concatenate ``<s> entry </s>`` streams and cut them into (windows, context + 1) rows."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in tokenizer(texts, verbose=False)["input_ids"]:
        stream.extend(ids + [eos])
    n = (len(stream) - 1) // context
    flat = torch.tensor(stream[: n * context + 1])
    return torch.stack([flat[i * context: i * context + context + 1] for i in range(n)])


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over all predicted positions of ``windows``."""
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(batch):
        logits = model(input_ids=chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total, count = total + loss.item(), count + chunk[:, 1:].numel()
    model.train()
    return total / count


def optimizer_for(model, cfg: dict) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norm weights)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg["lr"], betas=(0.9, 0.95))


def train(model, data: torch.Tensor, heldout: torch.Tensor, cfg: dict) -> dict:
    """Fixed-step training; returns the loss history (train per step, held-out every ``eval_every``)."""
    gen = torch.Generator().manual_seed(SEED)
    order = torch.randperm(len(data), generator=gen)
    opt = optimizer_for(model, cfg)
    history: dict = {"step": [], "train_loss": [], "eval_step": [], "heldout_loss": []}
    eval_windows = heldout[: cfg["eval_windows"]]
    model.train()
    bar = tqdm(range(cfg["steps"]), desc="training", unit="step")
    for step in bar:
        start = (step * cfg["batch"]) % (len(order) - cfg["batch"])
        batch = data[order[start:start + cfg["batch"]]]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        history["step"].append(step)
        history["train_loss"].append(loss.item())
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == cfg["steps"]:
            history["eval_step"].append(step)
            history["heldout_loss"].append(heldout_loss(model, eval_windows))
            bar.set_postfix(loss=f"{loss.item():.3f}", heldout=f"{history['heldout_loss'][-1]:.3f}")
    return history


def plot_history(history: dict, path: Path) -> None:
    """Loss curve (train, 20-step running mean, and held-out) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train_loss = torch.tensor(history["train_loss"])
    window = min(20, len(train_loss))
    smooth = torch.nn.functional.avg_pool1d(train_loss[None, None], window, 1).flatten()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["step"], history["train_loss"], color="0.8", lw=0.8, label="train (per step)")
    ax.plot(history["step"][window - 1:], smooth.tolist(), color="C0", label=f"train ({window}-step mean)")
    ax.plot(history["eval_step"], history["heldout_loss"], "o-", color="C1", label="held-out")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="detjac default model (GCIDE Llama)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "engine" / "assets" / "gcide-llama",
                        help="checkpoint folder (default: the shipped model's folder)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "detjac" / "corpus",
                        help="where the Debian package is kept")
    parser.add_argument("--steps", type=int, default=TRAIN["steps"], help="optimizer steps")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (part of reproducibility)")
    parser.add_argument("--loss-plot", type=Path, default=ROOT / "docs" / "default-model-loss.png")
    parser.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "data" / "heldout_prompts.txt")
    return parser.parse_args()


def load_corpus(cache: Path) -> tuple[list[str], list[str]]:
    """(train, held-out) entry lines of the pinned corpus."""
    print(f"corpus: Debian {gcide.PACKAGE} {gcide.VERSION} ({gcide.URL})")
    train_texts, heldout_texts = gcide.split_entries(gcide.entries(gcide.fetch_deb(cache)))
    print(f"entries: {len(train_texts)} train, {len(heldout_texts)} held out")
    return train_texts, heldout_texts


def save(model, tokenizer, out: Path, report: dict) -> str:
    """Write the checkpoint and ``training.json``; returns the weights' SHA-256."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id, do_sample=False, max_new_tokens=20)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    (out / "training.json").write_text(json.dumps(dict(report, model_safetensors_sha256=digest), indent=2) + "\n")
    return digest


def main() -> None:
    args = parse_args()
    cfg = dict(TRAIN, steps=args.steps)
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    started = time.time()

    train_texts, heldout_texts = load_corpus(args.cache)
    tokenizer = train_tokenizer(train_texts, VOCAB)
    data, heldout = pack(tokenizer, train_texts, CONTEXT), pack(tokenizer, heldout_texts, CONTEXT)
    print(f"tokens: {data[:, 1:].numel():,} train, {heldout[:, 1:].numel():,} held out (windows of {CONTEXT})")

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **MODEL)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama, {n_params:,} parameters, d_model {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers")

    history = train(model, data, heldout, cfg)
    final = heldout_loss(model, heldout)
    seconds = time.time() - started
    print(f"held-out loss {final:.4f} nats/token, perplexity {math.exp(final):.2f}; {seconds / 60:.1f} min in all")

    report = {"corpus": {"package": gcide.PACKAGE, "version": gcide.VERSION, "url": gcide.URL,
                         "sha256": gcide.SHA256, "licence": gcide.LICENCE},
              "entries": {"train": len(train_texts), "heldout": len(heldout_texts)},
              "tokens": {"train": int(data[:, 1:].numel()), "heldout": int(heldout[:, 1:].numel())},
              "seed": SEED, "threads": args.threads, "torch": torch.__version__, "model": MODEL,
              "vocab": len(tokenizer), "context": CONTEXT, "train": cfg, "parameters": n_params,
              "final_train_loss_20_step_mean": sum(history["train_loss"][-20:]) / 20,
              "heldout_loss": final, "heldout_perplexity": math.exp(final), "minutes": seconds / 60}
    digest = save(model, tokenizer, args.out, report)
    plot_history(history, args.loss_plot)
    args.prompts.parent.mkdir(parents=True, exist_ok=True)
    args.prompts.write_text("\n".join(entry_prefixes(heldout_texts, N_PROMPTS)) + "\n")
    print(f"wrote {args.out} (model.safetensors sha256 {digest}), {args.loss_plot}, {args.prompts}")


if __name__ == "__main__":
    main()
