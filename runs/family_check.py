"""``detjac families --check``: every registered family's tiny random model through the exactness report, on one
seeded random prompt, so that the detach rules of each family are seen to reconstruct its stock model's output."""

from __future__ import annotations

from typing import Any


def family_checks(tokens: int) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """Exactness reports of each family's tiny random model (float64, detached and ordinary), then of the tiny
    Llama in float32 and bfloat16 (detached only), on a prompt of ``tokens`` random ids (seed 0).

    Parameters
    ----------
    tokens : int
        The prompt's length.

    Returns
    -------
    tuple of (list, list)
        ``(model_type, ExactnessReport)`` per family, ``(dtype name, ExactnessReport)`` per lower precision.
    """
    import torch

    from detjac.engine import exactness_report, tiny_model, tiny_model_types

    prompt = torch.randint(3, 160, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    families = [(model_type, exactness_report(tiny_model(model_type), prompt)) for model_type in tiny_model_types()]
    dtypes = [(dt, exactness_report(tiny_model("llama", dtype=getattr(torch, dt)), prompt, ordinary=False))
              for dt in ("float32", "bfloat16")]
    return families, dtypes
