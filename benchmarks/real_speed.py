"""Speed and memory on the two real trained models, against the reference approach, in one run.

For SmolLM2-135M-Instruct (Llama: d 576, 30 layers, 9 query / 3 key-value heads, ffn 1536) and Gemma 3 270M
(d 640, 18 layers, 4 / 1 heads of 256, ffn 2048, vocabulary 262,144), dequantized from their GGUF files, at 8, 32
and 128 tokens of a fixed English text, in float32 and float64, three ways to the whole Jacobian of the output
(final normed state at the last position) w.r.t. the input embeddings:

reference
    ``torch.autograd.functional.jacobian(vectorize=True)`` of the detached (linearized) model, in memory.
memory
    detjac's in-memory engine (what ``detjac run`` uses by default): trace, then every row block.
streamed
    detjac's layer-streamed engine (``--streamed``), one decoder layer resident at a time, explicit sweeps, the next
    layer read ahead in a background thread.
budgeted
    the layer-streamed engine under ``--max-memory cpu=300MiB`` (decoded layers kept across passes where the budget
    leaves room).
memory_unfolded, streamed_sync
    baselines of the two levers, measured under the same load: the in-memory engine with its MLPs never folded
    (``folding("never")``), the streamed engine reading each layer in the caller's thread when asked (``SyncReader``).

Each (model, tokens, dtype, method) runs in a fresh process: the model is loaded, a 2-token prompt is run
first (kernels, allocator), the peak RSS is reset, then ``--repeat`` timed runs from the forward pass to the
last row; reported are the median seconds (and every run's), peak RSS above the loaded model, the seconds the
streamed engine waited on weights (``EngineStats.weight_wait_seconds``, median), and the largest difference from
the reference's J (relative to its largest entry). ``--rates`` adds, for every method, the FLOPs of its matrix
products and the share of torch.matmul's rate the run reached on them: every matrix product of one more (untimed)
run is recorded and replayed alone on random operands of the same layouts (``gemm_share``); ``matmul share =
replay seconds / run seconds`` (1.0: the run is nothing but its GEMMs at torch.matmul's speed); and the FLOP-model
rate against one 2048^2 product.

Results go to ``benchmarks/results/real_speed.json``, one record per case as it finishes; a rerun skips the
cases already there (``--redo`` recomputes them). Never a timed assertion: a report.

    .venv/bin/python -m benchmarks.real_speed                          # every case: hours on 2 cores
    .venv/bin/python -m benchmarks.real_speed --models smollm2 --tokens 8 --dtypes float64 --rates
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from detjac.machine import cpu_name, peak_mib, reset_peak

from .support.flops import matmul_flops
from .support.shipped import SHIPPED, shipped_gguf

RESULTS = Path(__file__).parent / "results" / "real_speed.json"
METHODS = ("reference", "memory", "streamed", "budgeted", "memory_unfolded", "streamed_sync")
BUDGET = "cpu=300MiB"
# Written for the real-model benchmarks: an ordinary English paragraph, long enough for 128 tokens in both tokenizers.
TEXT = (Path(__file__).parent / "data" / "harbour.txt").read_text(encoding="utf-8").strip()


def _ids(engine: Any, n: int) -> list[int]:
    ids = engine.tokenizer(TEXT, add_special_tokens=True)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"Expected at least {n} tokens of the benchmark text. Got {len(ids)}.")
    return list(ids[:n])


def _flops(cfg: Any, n: int) -> float:
    """FLOP model of pulling all d rows back through every layer (``streamed.sweep_flops``, GQA widths)."""
    from .support.flops import sweep_flops

    c = cfg.get_text_config()
    shape = {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
             "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
             "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads}
    d, layers = c.hidden_size, c.num_hidden_layers
    whole = sweep_flops(shape, n, d, 1)
    return whole * layers - (whole - sweep_flops(shape, n, d, 1, queries=1))


def child(model: str, n: int, dtype_name: str, method: str, threads: int, rates: bool, repeat: int,
          out: str) -> dict[str, Any]:
    import statistics

    import torch

    from detjac.engine import assemble, load_engine
    from detjac.engine.detach.model import linearized
    from detjac.engine.pieces import fold
    from detjac.targets import OUTPUTS

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    path = shipped_gguf(model)
    t0 = time.perf_counter()
    streamed = method in ("streamed", "budgeted", "streamed_sync")
    engine = load_engine(path, streamed=streamed, dtype=dtype, max_memory=BUDGET if method == "budgeted" else None)
    load_s = time.perf_counter() - t0
    if method == "streamed_sync":
        from detjac.engine.streamed.prefetch import SyncReader

        feed = engine.skeleton.feed
        feed.reader = SyncReader(feed.reader.read)
    mode = "never" if method == "memory_unfolded" else "auto"
    ids = _ids(engine, n)

    if method == "reference":
        def run(prompt: list[int]) -> Any:
            with linearized(engine.model) as lin:
                x = lin.decoder.get_input_embeddings()(torch.tensor([prompt]))[0].detach()
                return torch.autograd.functional.jacobian(
                    lambda e: lin.decoder(inputs_embeds=e[None], use_cache=False).last_hidden_state[0, -1], x,
                    vectorize=True)
    else:
        def run(prompt: list[int]) -> Any:
            with fold.folding(mode):
                trace = engine.trace(prompt)
                return assemble(engine, trace, [OUTPUTS], engine.plan(trace, [OUTPUTS]))[OUTPUTS]

    run(ids[:2])
    stats = getattr(engine, "stats", None)
    read_before = getattr(stats, "bytes_read", 0)
    base = reset_peak()
    runs, waits = [], []
    for _ in range(repeat):
        waited = getattr(stats, "weight_wait_seconds", 0.0)
        t0 = time.perf_counter()
        jac = run(ids)
        runs.append(time.perf_counter() - t0)
        waits.append(getattr(stats, "weight_wait_seconds", 0.0) - waited)
    seconds = statistics.median(runs)
    peak = peak_mib() - base
    torch.save(jac, out)
    record: dict[str, Any] = {"seconds": seconds, "runs": runs, "peak_mib": peak, "load_seconds": load_s,
                              "jacobian_mib": jac.numel() * jac.element_size() / 2**20,
                              "n_tokens": len(ids), "token_ids": ids}
    if method != "reference":
        record["bytes_read"] = (getattr(stats, "bytes_read", 0) - read_before) // repeat  # one timed run's reads
        record["waited_on_weights"] = statistics.median(waits)
        record["row_block"] = row_block = engine.plan(engine.trace(ids), [OUTPUTS]).row_block
        c = engine.config.get_text_config()
        record["folded"] = method != "memory_unfolded" and fold.fold_pays(c.hidden_size, c.intermediate_size,
                                                                          row_block)
        for key in ("layers_prefetched", "layers_kept", "layers_read_unused"):
            record[key] = getattr(stats, key, 0)
    if rates:
        from .support.gemm_share import gemm_flops, record_gemms, replay_seconds

        calls = record_gemms(lambda: run(ids))
        replay = replay_seconds(calls)
        flops = _flops(engine.config, n)  # the reference pulls every row through the top layer at every position
        square = matmul_flops(dtype)
        record.update({"gemm_calls": len(calls), "gemm_flops": gemm_flops(calls), "replay_seconds": replay,
                       "matmul_share": replay / seconds, "model_flops": flops,
                       "square_matmul_gflops": square / 1e9, "square_share": flops / seconds / square})
    return record


def _compare(ref: str, got: str) -> float:
    import torch

    a, b = torch.load(ref), torch.load(got)
    return float((a.double() - b.double()).abs().max() / a.double().abs().max())


def _key(model: str, n: int, dtype: str, method: str) -> str:
    return f"{model}/{n}/{dtype}/{method}"


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {"cases": {}}


def _save(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, path)


def _table(results: dict[str, Any]) -> str:
    cases = results["cases"]
    rated = any("matmul_share" in c for c in cases.values())  # --rates was given for some case
    shown = ("memory", "streamed", "budgeted", "memory_unfolded", "streamed_sync")
    lines = [f"{'model':<8} {'tokens':>6} {'dtype':<8} {'reference':>10} "
             + " ".join(f"{m:>16}" for m in shown)
             + f" {'str/bud vs mem':>15} {'waited s str/bud/sync':>22} {'peak MiB ref/mem/str/bud':>25}"
             + (f" {'matmul share':>17}" if rated else "")]
    for model in SHIPPED:
        for n in sorted({c["n"] for c in cases.values() if c["model"] == model}):
            for dtype in ("float32", "float64"):
                got = {m: cases.get(_key(model, n, dtype, m)) for m in METHODS}
                ref = got["reference"]
                if ref is None:
                    continue
                cells = [f"{c['seconds']:7.2f} ({c['seconds'] / ref['seconds']:.2f}x)" if c else "-"
                         for c in (got[m] for m in shown)]
                waited = "/".join(f"{c['waited_on_weights']:.2f}" if c and "waited_on_weights" in c else "-"
                                  for c in (got["streamed"], got["budgeted"], got["streamed_sync"]))
                peaks = "/".join(f"{c['peak_mib']:.0f}" if c else "-"
                                 for c in (got[m] for m in ("reference", "memory", "streamed", "budgeted")))
                mem = got["memory"]
                vs_memory = "/".join(f"{c['seconds'] / mem['seconds']:.2f}x" if c and mem else "-"
                                     for c in (got["streamed"], got["budgeted"]))
                shares = "/".join(f"{c['matmul_share']:.2f}" if c and "matmul_share" in c else "-"
                                  for c in (got[m] for m in ("reference", "memory", "streamed")))
                lines.append(f"{model:<8} {n:>6} {dtype:<8} {ref['seconds']:10.2f} "
                             + " ".join(f"{c:>16}" for c in cells)
                             + f" {vs_memory:>15} {waited:>22} {peaks:>25}" + (f" {shares:>17}" if rated else ""))
    return "\n".join(lines)


def _measure(model: str, n: int, dtype: str, pending: list[str], args: argparse.Namespace,
             results: dict[str, Any]) -> None:
    """Each pending method in a fresh process (``args.repeat`` timed runs there, the median kept), compared with
    the reference's J; each record is saved as it finishes."""
    ref_file = args.work / f"{model}-{n}-{dtype}-reference.pt"  # kept: the baseline of later reruns
    runs = [m for m in METHODS if m in pending]
    if "reference" not in runs and not ref_file.is_file():
        runs.insert(0, "reference")
    for method in runs:
        key = _key(model, n, dtype, method)
        out = ref_file if method == "reference" else args.work / f"{method}.pt"
        cmd = [sys.executable, "-m", __spec__.name, "--threads", str(args.threads), "--repeat", str(args.repeat),
               *(["--rates"] if args.rates else []), "--child", model, str(n), dtype, method, str(out)]
        print(f"{time.strftime('%H:%M:%S')} {key} ...", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{key} failed:\n{proc.stderr[-3000:]}")
        record = json.loads(proc.stdout.strip().splitlines()[-1])
        record.update({"model": model, "n": n, "dtype": dtype, "method": method})
        if method != "reference":
            record["max_rel_diff_from_reference"] = _compare(str(ref_file), str(out))
            out.unlink()
        print(f"  median {record['seconds']:.2f} s of " + ", ".join(f"{r:.2f}" for r in record["runs"])
              + f", peak +{record['peak_mib']:.0f} MiB"
              + (f", max diff {record['max_rel_diff_from_reference']:.1e}"
                 if "max_rel_diff_from_reference" in record else ""), flush=True)
        if method in pending:  # a reference run only as the comparison's baseline is not kept
            results["cases"][key] = record
            _save(results, args.results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(SHIPPED))
    p.add_argument("--tokens", default="8,32,128")
    p.add_argument("--dtypes", default="float32,float64")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rates", action="store_true", help="also record and replay each run's GEMMs (two more runs)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each case (in its fresh process, after "
                   "the warm-up); the median is reported (default: %(default)s)")
    p.add_argument("--redo", action="store_true", help="recompute cases already in the results")
    p.add_argument("--table", action="store_true", help="print the results table and stop")
    p.add_argument("--results", type=Path, default=RESULTS, help="the results file (default: %(default)s)")
    p.add_argument("--note", help="a note stored with the results (e.g. what else ran on the machine)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "detjac-real-speed",
                   help="folder for the Jacobians compared (the references are kept for reruns)")
    p.add_argument("--child", nargs=5, metavar=("MODEL", "N", "DTYPE", "METHOD", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"expected --repeat of 1 or more; got {args.repeat}")
    if args.child:
        model, n, dtype, method, out = args.child
        print(json.dumps(child(model, int(n), dtype, method, args.threads, args.rates, args.repeat, out)))
        return
    results = _load(args.results)
    if args.note:
        results["note"] = args.note
    if args.table:
        print(_table(results))
        return
    results["machine"] = {"cpu": cpu_name(), "cores": os.cpu_count(),
                          "threads": args.threads, "python": platform.python_version()}
    methods = [m for m in METHODS if m in args.methods.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    for model in args.models.split(","):
        for n in (int(t) for t in args.tokens.split(",")):
            for dtype in args.dtypes.split(","):
                pending = [m for m in methods if args.redo or _key(model, n, dtype, m) not in results["cases"]]
                if not pending:
                    print(f"{model}/{n}/{dtype}: already measured", flush=True)
                    continue
                _measure(model, n, dtype, pending, args, results)
    print(_table(results))


if __name__ == "__main__":
    main()
