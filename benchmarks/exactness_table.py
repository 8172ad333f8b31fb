"""Reconstruction error per family and dtype on the tiny random models (a report, no assertion).

    .venv/bin/python -m benchmarks.exactness_table --tokens 13
"""

from __future__ import annotations

import argparse

import torch

from detjac.engine import InMemoryEngine, jacobian
from detjac.engine.checkpoints.tiny import tiny_model, tiny_model_types
from detjac.engine.tools.exactness_report import exactness_report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=13)
    args = p.parse_args()
    ids = torch.randint(3, 160, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"{'family':<12} {'f64 detached':>12} {'f64 ordinary':>12} {'f64 |logit-stock|':>17} "
          f"{'f32 detached':>12} {'bf16 detached':>13}")
    for mt in tiny_model_types():
        rep = exactness_report(tiny_model(mt), ids)
        f32 = jacobian(InMemoryEngine(tiny_model(mt, dtype=torch.float32)), ids).reconstruction_error
        bf16 = jacobian(InMemoryEngine(tiny_model(mt, dtype=torch.bfloat16)), ids).reconstruction_error
        print(f"{mt:<12} {rep.detached.reconstruction_error:>12.2e} {rep.ordinary.reconstruction_error:>12.2e} "  # type: ignore[union-attr]
              f"{rep.stock_logit_diff:>17.2e} {f32:>12.2e} {bf16:>13.2e}")


if __name__ == "__main__":
    main()
