"""``detjac attention``: the JSON it writes (every pair, terms summing to the score) and the table it prints; bad
input refused with one line and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from detjac.cli.main import main

PROMPT = "The fog rolls over the bay in the morning"


@pytest.fixture(scope="module")
def written(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("qk") / "qk.json"
    result = CliRunner().invoke(main, ["attention", str(llama_checkpoint), "-p", PROMPT, "--layer", "2", "--head",
                                       "1", "--neurons", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.output


def test_the_json_holds_every_pair_and_sums_to_the_score(written: tuple[dict, str]) -> None:
    data, _ = written
    n = len(data["tokens"])
    assert (data["layer"], data["head"], data["query_position"]) == (2, 1, n - 1)
    assert data["model"]["family"] == "Llama" and data["model"]["dtype"] == "float64"
    assert len(data["model"]["weights_sha256"]) == 64  # the checkpoint's identity
    assert [k["position"] for k in data["keys"]] == list(range(n))  # causal: every key up to the query
    components = 1 + 2 * (4 + 2 + 1)  # E; per layer below: 4 heads, 2 neurons, the rest
    for key in data["keys"]:
        assert len(key["terms"]) == components ** 2
        assert abs(sum(t["value"] for t in key["terms"]) - key["score"]) < 1e-12 * max(1.0, abs(key["score"]))
    assert abs(sum(k["probability"] for k in data["keys"]) - 1) < 1e-12
    assert data["score_error"] < 1e-12 and data["residual_error"] < 1e-13


def test_the_table_shows_the_pattern_and_the_top_terms(written: tuple[dict, str]) -> None:
    data, output = written
    lines = output.splitlines()
    assert lines[0].startswith("model ") and "(Llama, float64)" in lines[0]
    first = data["keys"][0]
    row = next(line for line in lines if line.split()[:1] == ["0"])
    assert repr(data["tokens"][0]) in row and f"{first['probability']:.3f}" in row
    best = max(data["keys"], key=lambda k: k["probability"])
    at = lines.index(next(line for line in lines if line.startswith(f"top terms at key {best['position']} ")))
    top = best["terms"][0]
    assert lines[at + 1].split() == [top["query"], "x", top["key"], f"{top['value']:.4g}"]
    assert lines[-1].startswith("wrote ")


@pytest.mark.parametrize(("args", "message"), [
    (["--layer", "3", "--head", "0"], "Error: Expected a layer in [0, 2] (the model has 3 layers). Got 3."),
    (["--layer", "0", "--head", "4"], "Error: Expected a head in [0, 3]"),
    (["--layer", "0", "--head", "0", "--query", "40"], "Error: Expected a position in"),
    (["--layer", "0", "--head", "0", "--neurons", "-1"], "Error: Expected neurons to be a non-negative integer. "
                                                          "Got -1."),
])
def test_bad_input_is_one_line_and_writes_nothing(llama_checkpoint: Path, tmp_path: Path, args: list[str],
                                                  message: str) -> None:
    out = tmp_path / "qk.json"
    result = CliRunner().invoke(main, ["attention", str(llama_checkpoint), "-p", PROMPT, *args, "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert result.output.strip().startswith(message) and len(result.output.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_unsupported_family_is_refused_by_name(tmp_path: Path) -> None:
    from detjac.engine.checkpoints.tiny import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "bert", "bert")
    result = CliRunner().invoke(main, ["attention", str(ckpt), "-p", "a b", "--layer", "0", "--head", "0"])
    assert result.exit_code == 1
    assert result.output.strip().startswith("Error: Expected a causal decoder family for a QK attribution")
    assert "Got BERT" in result.output
