"""Conformance: every registered family is exercised by the exactness suite; decoding helpers."""

from __future__ import annotations

import torch

from detjac.engine import FAMILIES
from detjac.engine.checkpoints.tiny import tiny_model_types
from detjac.engine.products.decode import decode_top, dense_svd


def test_every_registered_family_has_a_tiny_model_under_test():
    # A family without the float64 reconstruction test is not supported.
    assert set(FAMILIES) <= set(tiny_model_types())


def test_the_lazy_table_names_every_family_file_and_its_model_types():
    import importlib
    import subprocess
    import sys
    from pathlib import Path

    from detjac.engine import families

    files = {p.stem for p in Path(families.__file__).parent.glob("*.py")} - {"__init__", "base"}
    assert set(families._FILES) == files
    for name, types in families._FILES.items():
        assert importlib.import_module(f"detjac.engine.families.{name}").FAMILY.model_types == types, name
    # asking for one family imports its file only (each imports its transformers modeling module)
    code = ("import sys; from detjac.engine.families import family_for; from types import SimpleNamespace as S; "
            "family_for(S(model_type='llama')); print(sorted(m for m in sys.modules if '.families.' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "families.llama" in out and "families.bert" not in out and "families.gemma3" not in out


def test_every_family_declares_rules():
    for family in FAMILIES.values():
        # an MLP is gated (a rule), a mixture of experts (a rule), or ungated (activations, affine families only)
        assert family.norms and (family.mlps or family.moes or family.affine), family.name
        assert family.attentions and family.containers, family.name
        rules = len(family.norms) + len(family.mlps) + len(family.moes) + len(family.attentions) + family.affine
        assert len(family.describe()) == rules


def test_dense_svd_matches_svd_and_orients_by_output():
    gen = torch.Generator().manual_seed(0)
    op = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(6, generator=gen, dtype=torch.float64)
    svd = dense_svd(op, 3, orient=y)
    assert torch.allclose(svd.S, torch.linalg.svdvals(op)[:3])
    assert torch.all(y @ svd.U >= 0)
    # each oriented pair still satisfies op v = s u
    assert torch.allclose(op @ svd.V, svd.U * svd.S, atol=1e-12)


def test_decode_top_ranks_by_projection():
    matrix = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [-3.0, 0.0]], dtype=torch.float64)
    vectors = torch.tensor([[1.0], [0.0]], dtype=torch.float64)  # (d=2, k=1)
    ids, scores = decode_top(vectors, matrix, top=2)
    assert ids.tolist() == [[2, 0]] and scores.tolist() == [[2.0, 1.0]]
