"""`detjac steer --method paper`: the reference's steering procedure, against a hand-written implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from store_helpers import run_default

from detjac.cli.main import main
from detjac.engine.tools.steer import SteeringOperator, generate
from detjac.errors import InvalidArgumentError
from detjac.runs.steering import concept_operator, load_concept

CONCEPT = "Whale, n. (Zool.) Any aquatic mammal"
PROMPT = "Ream, n. A bundle of"


@pytest.fixture(scope="module")
def concept_store(tmp_path_factory):
    return run_default(tmp_path_factory.mktemp("steer-paper"), [CONCEPT], "c.zarr", "--layers", "1,2",
                       "--components", "layer,layer_normed")


def reference_steering(model, J: np.ndarray, layer: int, ids: list[int], strength: float, steps: int
                       ) -> tuple[list[int], torch.Tensor]:
    """The formula written out, recomputing the whole sequence every step (no cache): at every position i,
    ``a_i = sum_{k<=i} J[:, k mod n, :] x_k`` is added to layer ``layer``'s input as ``λ ||h_i|| a_i / (2 ||a_i||)``.
    Returns the greedy continuation and the first step's last-position logits."""
    n = J.shape[1]
    ops = torch.from_numpy(J)
    ids, first = list(ids), None
    for _ in range(steps):
        with torch.no_grad():
            x = model.get_input_embeddings()(torch.tensor([ids]))[0]  # (m, d)
            acc, added = torch.zeros(x.shape[1], dtype=x.dtype), []
            for i in range(len(ids)):
                acc = acc + ops[:, i % n, :] @ x[i]
                added.append(acc.clone())
            h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[layer][0]  # layer's input
            steered = torch.stack([h[i] + strength * h[i].norm() * added[i] / (2 * added[i].norm())
                                   for i in range(len(ids))])

            def swap(_m, args, kwargs, steered=steered):
                return ((steered[None], *args[1:]), kwargs) if args else (args, {**kwargs,
                                                                                  "hidden_states": steered[None]})

            handle = model.model.layers[layer].register_forward_pre_hook(swap, with_kwargs=True)
            try:
                logits = model(torch.tensor([ids])).logits[0, -1]
            finally:
                handle.remove()
        first = logits if first is None else first
        ids.append(int(logits.argmax()))
    return ids[-steps:], first


@pytest.mark.parametrize("layer", [1, 2])
def test_paper_method_equals_the_formula_written_out(concept_store, layer: int) -> None:
    pid = concept_store.prompt_ids()[0]
    session = load_concept("default", concept_store.path, pid, layer, dtype="float64", method="paper")
    op, model, tok = session.operator, session.model, session.tokenizer
    assert op.method == "paper" and op.layer == layer
    ids = tok(PROMPT)["input_ids"]
    J = np.asarray(concept_store.get(pid).layerwise(f"layer_normed.{layer}", lazy=False), dtype=np.float64)
    expected, first_logits = reference_steering(model, J, layer, ids, 3.0, 8)
    assert generate(model, ids, 8, op, 3.0) == expected
    from detjac.engine.tools.steer import steering

    with torch.no_grad(), steering(model, op, 3.0):
        logits = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits, first_logits, rtol=0, atol=1e-10)
    assert generate(model, ids, 8) != expected  # the steering changes the continuation at this strength
    # without layer_normed stored, diag(g) layer.L steers identically (the 1 / rms factor cancels)
    fallback = SteeringOperator.from_jacobian(layer, torch.from_numpy(
        concept_store.model_array("final_norm")[:, None, None] * concept_store.get(pid).layerwise(
            f"layer.{layer}", lazy=False)), method="paper")
    x = model.get_input_embeddings()(torch.tensor([ids]))[0]
    a, b = op.vectors(x), fallback.vectors(x)
    torch.testing.assert_close(a / a.norm(dim=-1, keepdim=True), b / b.norm(dim=-1, keepdim=True),
                               rtol=0, atol=1e-12)


def test_method_choices_and_missing_operators(concept_store, tmp_path) -> None:
    pid = concept_store.prompt_ids()[0]
    with pytest.raises(InvalidArgumentError, match="detjac, paper"):
        SteeringOperator(0, torch.zeros(1, 2, 2), method="golden")
    with pytest.raises(InvalidArgumentError, match="detjac, paper"):
        load_concept("default", concept_store.path, pid, 1, method="golden")
    only_mlp = run_default(tmp_path, [CONCEPT], "m.zarr", "--layers", "1", "--components", "mlp")
    model = load_concept("default", concept_store.path, pid, 1).model
    with pytest.raises(InvalidArgumentError, match="layer_normed.1"):
        concept_operator(only_mlp, only_mlp.prompt_ids()[0], 1, model, "paper")
    out = CliRunner().invoke(main, ["steer", "--concept-from", f"{concept_store.path}:{pid}", "--layer", "1",
                                    "--method", "paper", "--strength", "2", "--prompt", PROMPT,
                                    "--max-new-tokens", "4"])
    assert out.exit_code == 0 and "method paper" in out.output, out.output


# `detjac run` of the default model and 16 greedy steps of it: seconds.
pytestmark = pytest.mark.slow
