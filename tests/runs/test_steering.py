"""Steering from a store (runs/steering.py): the concept operator, its checks, one steered generation, the
concept tokens and the evaluation table, on the default model."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from store_helpers import run_default, write_prompts

from detjac.engine.tools.steer import generate
from detjac.errors import InvalidArgumentError, PromptsFileError
from detjac.runs.steering import (
    concept_ids,
    concept_operator,
    evaluate_steering,
    load_concept,
    prepare_evaluation,
    steer_prompt,
)

CONCEPT = "Whale, n. (Zool.) Any aquatic mammal"

pytestmark = pytest.mark.slow  # a layerwise run and a model load


@pytest.fixture(scope="module")
def concept_store(tmp_path_factory):
    return run_default(tmp_path_factory.mktemp("steering"), [CONCEPT], "c.zarr", "--layers", "1",
                       "--components", "layer")


@pytest.fixture(scope="module")
def session(concept_store):
    return load_concept("default", concept_store.path, concept_store.prompt_ids()[0], -3, dtype="float64")


def test_the_operator_is_the_stored_layer_jacobian(concept_store, session):
    prompt = next(iter(concept_store))
    op = session.operator
    assert op.layer == 1 and op.concept == CONCEPT  # -3 of 4 layers
    J = prompt.layerwise("layer.1", lazy=False)  # (d, n, d)
    assert op.operators.shape == (prompt.n_tokens, J.shape[0], J.shape[2])
    np.testing.assert_array_equal(op.operators.numpy(), np.transpose(J, (1, 0, 2)))
    assert op.operators.dtype == session.model.dtype == torch.float64


def test_the_operator_is_refused_for_the_wrong_layer_or_model(concept_store, session, llama_checkpoint):
    from detjac.engine import load_model

    pid = concept_store.prompt_ids()[0]
    with pytest.raises(InvalidArgumentError, match=r"Expected a layer in \[-4, 4\). Got 4."):
        concept_operator(concept_store, pid, 4, session.model)
    with pytest.raises(InvalidArgumentError, match="Expected the layerwise Jacobian layer.2 with prompt .* Got "
                                                   "layer.1: run `detjac run MODEL CONCEPT.txt"):
        concept_operator(concept_store, pid, 2, session.model)
    other = load_model(llama_checkpoint, dtype=torch.float64)
    with pytest.raises(InvalidArgumentError, match="Expected the store's model to be this model"):
        concept_operator(concept_store, pid, 1, other)


def test_a_concept_store_of_another_model_is_refused_naming_both(concept_store, tmp_path):
    """Same config and embeddings (so the embedding check alone would pass), one layer's weights changed."""
    import shutil

    from safetensors.torch import load_file, save_file

    from detjac.engine.checkpoints.default import DEFAULT_MODEL_DIR

    folder = tmp_path / "perturbed"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"].mul_(1.01)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InvalidArgumentError, match=r"Expected a store of the model .*perturbed\. Got c\.zarr, "
                                                   r"written with .*weights_sha256: \w+… \(c\.zarr\) != \w+… "):
        load_concept(str(folder), concept_store.path, concept_store.prompt_ids()[0], 1)


def test_one_steered_generation(session):
    ids = session.tokenizer("Ream, n. A bundle of")["input_ids"]
    plain = session.tokenizer.decode(generate(session.model, ids, 6))
    steered = steer_prompt(session, "Ream, n. A bundle of", 4.0, max_new_tokens=6)
    assert steered.unsteered == plain and steered.strength == 4.0
    assert steered.steered != plain  # a strong push changes the greedy continuation
    assert steer_prompt(session, "Ream, n. A bundle of", 0.0, max_new_tokens=6).steered == plain


def test_concept_tokens_from_words_or_from_the_concept_prompt(session):
    tok = session.tokenizer
    words = concept_ids(tok, CONCEPT, " aquatic, mammal")
    assert words == {tok(" aquatic", add_special_tokens=False)["input_ids"][0],
                     tok(" mammal", add_special_tokens=False)["input_ids"][0]}
    default = concept_ids(tok, CONCEPT)
    texts = [tok.decode([t]) for t in tok(CONCEPT)["input_ids"]]
    assert {tok.decode([t]) for t in default} == {t for t in texts if sum(c.isalpha() for c in t) >= 4}
    assert " aquatic" in {tok.decode([t]) for t in default}


def test_the_evaluation_table(session, tmp_path):
    prompts = write_prompts(tmp_path / "p.txt", ["Ream, n. A bundle of", "", "Limber, v. t. To attach"])
    evaluation = prepare_evaluation(session, prompts, " aquatic, mammal")
    assert evaluation.prompts == ["Ream, n. A bundle of", "Limber, v. t. To attach"]  # blank lines skipped
    assert evaluation.concept_tokens == [session.tokenizer.decode([t]) for t in sorted(evaluation.concept_ids)]
    table = evaluate_steering(session, evaluation, [0.0, 4.0], max_new_tokens=5, table=tmp_path / "s.csv",
                              progress=False)
    assert [r["strength"] for r in table.rows] == [0.0, 4.0] and all(r["prompts"] == 2 for r in table.rows)
    unsteered = session.tokenizer.decode(generate(session.model, session.tokenizer(evaluation.prompts[0])
                                                  ["input_ids"], 5))
    assert table.rows[0]["example"] == unsteered
    with open(table.table, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [float(r["strength"]) for r in rows] == [0.0, 4.0] and rows[0]["example"] == unsteered
    assert evaluate_steering(session, evaluation, [0.0], max_new_tokens=2, progress=False).table is None

    with pytest.raises(PromptsFileError, match=r"Expected at least one prompt in .*blank.txt. Got an empty file"):
        prepare_evaluation(session, write_prompts(tmp_path / "blank.txt", ["", "  "]))
    nothing = prepare_evaluation(session, prompts, ",")
    with pytest.raises(InvalidArgumentError, match="Expected at least one concept token to count"):
        evaluate_steering(session, nothing, [1.0], max_new_tokens=2, progress=False)
