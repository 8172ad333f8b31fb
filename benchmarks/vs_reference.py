"""Row-block engine vs. the reference approach, on one machine, in one run.

The reference (the paper's code) computes the whole Jacobian at once with
``torch.autograd.functional.jacobian(vectorize=True)`` on the detached forward. detjac
pushes ``row_block`` cotangents at a time through one ``torch.func.vjp`` pullback. Each
method runs in a fresh process on the same random Llama (float64); we report wall time,
peak RSS growth over the loaded model, their ratios, and the max |difference| of the two
Jacobians. Never a timed assertion: this is a report.

    .venv/bin/python -m benchmarks.vs_reference --d-model 256 --layers 4 --tokens 16
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _worker(method: str, args: argparse.Namespace) -> dict[str, float]:
    import torch

    from detjac.engine import InMemoryEngine, jacobian
    from detjac.engine.checkpoints.tiny import tiny_model
    from detjac.engine.detach.model import linearized

    torch.set_num_threads(args.threads)
    heads = max(1, args.d_model // 64)
    model = tiny_model("llama", hidden_size=args.d_model, intermediate_size=4 * args.d_model,
                       num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                       vocab_size=1000, max_position_embeddings=max(64, args.tokens))
    ids = torch.randint(3, 1000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    jacobian(InMemoryEngine(model), ids[:2], row_block=args.row_block)  # warm up kernels and allocator
    base = _rss_mib()
    t0 = time.perf_counter()
    if method == "detjac":
        jac = jacobian(InMemoryEngine(model), ids, row_block=args.row_block).jacobian
    else:
        with linearized(model) as lin:
            x = lin.decoder.get_input_embeddings()(torch.tensor([ids]))[0]
            jac = torch.autograd.functional.jacobian(
                lambda e: lin.decoder(inputs_embeds=e[None], use_cache=False).last_hidden_state[0, -1],
                x, vectorize=True)
    seconds = time.perf_counter() - t0
    torch.save(jac, args.out + f".{method}.pt")
    return {"seconds": seconds, "peak_mib": _rss_mib() - base}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--row-block", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="/tmp/detjac-bench")
    p.add_argument("--worker", choices=["detjac", "reference"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args)))
        return
    res = {}
    for method in ("reference", "detjac"):
        cmd = [sys.executable, "-m", __spec__.name, "--worker", method] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "worker"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        res[method] = json.loads(out.strip().splitlines()[-1])
    import torch

    diff = (torch.load(args.out + ".detjac.pt") - torch.load(args.out + ".reference.pt")).abs().max()
    print(f"Llama d_model={args.d_model} layers={args.layers} tokens={args.tokens} float64, "
          f"row_block={args.row_block}, {args.threads} threads")
    for m, r in res.items():
        print(f"  {m:<10} {r['seconds']:8.2f} s   peak RSS +{r['peak_mib']:8.1f} MiB")
    ref, ours = res["reference"], res["detjac"]
    print(f"  ratio reference/detjac: time {ref['seconds'] / ours['seconds']:.2f}x, "
          f"peak memory {ref['peak_mib'] / max(ours['peak_mib'], 1e-9):.2f}x")
    print(f"  max |J_detjac - J_reference| = {float(diff):.2e}")


if __name__ == "__main__":
    main()
