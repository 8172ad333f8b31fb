"""The committed output of ``scripts/jlens_agreement.py`` says what docs/lens.md says of it: on the default model and
on SmolLM2 (16 fit texts, 40 evaluation prompts) detjac's ordinary ``jlens`` equals TransformerLens 4.3.0's within
float32 rounding, and each side's artifact read by the other gives the same top-10 sets and top 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "jlens_agreement.json"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "lens.md"


@pytest.mark.parametrize("model, layers, worst", [("default", 3, 3e-7), ("smollm2", 29, 1e-5)])
def test_the_committed_agreement_is_the_full_check(model, layers, worst):
    r = json.loads(RESULTS.read_text())[model]
    assert (r["fit_prompts"], r["eval_prompts"]) == (16, 40), "the benchmark's sets: 16 fit texts, 40 prompts"
    assert r["same_fit_tokens"] and len(r["layers"]) == layers
    assert r["worst_max_abs_diff_over_max_abs"] < worst
    for side in ("tl_reads_detjac_artifact_vs_detjac", "detjac_reads_tl_artifact_vs_tl"):
        got = r[side]
        assert got["readings"] == 40 * layers and got["top10_set_equal"] == 1.0 and got["top1_equal"] == 1.0
        assert got["top10_ordered_equal"] >= 0.99
    text = PAGE.read_text(encoding="utf-8")
    assert f"{40 * layers:,} readings" in text or f"{40 * layers} readings" in text
