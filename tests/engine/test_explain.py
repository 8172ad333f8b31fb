"""Decoded singular triplets, checked against an independent SVD; the spectra plot."""

from __future__ import annotations

import pytest
import torch

from detjac.analysis.plots import SpectrumPanel, plot_spectra
from detjac.engine import InMemoryEngine, jacobian
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.engine.tools.triplets import explain


@pytest.fixture(scope="module")
def explained():
    model = tiny_model("llama", seed=3)
    res = jacobian(InMemoryEngine(model), list(range(5, 14)))
    return model, res, explain(res, model, k=3, top=4)


def test_combined_triplets_match_an_independent_svd(explained):
    model, res, expl = explained
    combined = res.jacobian.reshape(res.jacobian.shape[0], -1)
    U, S, Vh = torch.linalg.svd(combined, full_matrices=False)
    torch.testing.assert_close(expl.combined.spectrum, S)
    unembed = model.lm_head.weight
    for i in range(3):
        u = U[:, i] if U[:, i] @ res.output >= 0 else -U[:, i]  # oriented along the output
        assert torch.equal(expl.combined.left_ids[i], (unembed @ u).topk(4).indices)
        v = (Vh[i] if U[:, i] @ res.output >= 0 else -Vh[i]).reshape(len(res.token_ids), -1)
        pos = int(v.pow(2).sum(-1).argmax())
        assert expl.combined.right_positions[i] == pos
        assert expl.combined.right_shares[i] == pytest.approx(float(v[pos].pow(2).sum()))
        assert torch.equal(expl.combined.right_ids[i], (model.model.embed_tokens.weight @ v[pos]).topk(4).indices)


def test_per_token_triplets_are_oriented_by_their_own_contribution(explained):
    model, res, expl = explained
    assert [op.position for op in expl.per_token] == list(range(len(res.token_ids)))
    for op in expl.per_token:
        J = res.operator(op.position)
        torch.testing.assert_close(op.spectrum, torch.linalg.svdvals(J))
        U, _, _ = torch.linalg.svd(J)
        contribution = J @ res.embeddings[op.position]
        u1 = U[:, 0] if U[:, 0] @ contribution >= 0 else -U[:, 0]
        assert torch.equal(op.left_ids[0], (model.lm_head.weight @ u1).topk(4).indices)
        assert op.right_shares == [1.0] * 3


def test_plot_spectra_writes_the_file_type_asked(tmp_path, explained):
    _, _, expl = explained
    panel = SpectrumPanel("p", expl.combined.spectrum.tolist(), {"0:a": expl.per_token[0].spectrum.tolist()})
    svg = plot_spectra([panel, panel], tmp_path / "s.svg")
    assert svg.read_text().lstrip().startswith("<?xml") and "svg" in svg.read_text()[:500]
    with pytest.raises(ValueError, match="Expected at least one spectrum panel"):
        plot_spectra([], tmp_path / "none.png")
