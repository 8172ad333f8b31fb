"""``detjac attention``: the JSON it writes (every pair, terms summing to the score) and the table it prints; bad
input refused with one line and nothing written."""

from __future__ import annotations

import json
import math
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


def table(lines: list[str], title: str) -> list[tuple[str, str]]:
    """The rows under the first line starting with ``title``, as (name, value as printed), up to the next title."""
    at = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[at + 1:]:
        if not line.startswith("  "):
            break
        name, value = line.strip().rsplit(None, 1)
        rows.append((" ".join(name.split()), value))
    return rows


def expected(pairs: list[tuple[str, float]], top: int, what: str) -> list[tuple[str, str]]:
    """A printed table: the ``top`` largest and the others' sum, so the rows add up to the total."""
    shown, rest = pairs[:top], pairs[top:]
    return [(name, f"{value:.4g}") for name, value in shown] + \
        ([(f"the other {len(rest)} {what}", f"{math.fsum(v for _, v in rest):.4g}")] if rest else [])


def test_the_attended_key_is_explained_by_each_side_s_sums_then_its_pairs(written: tuple[dict, str]) -> None:
    data, output = written
    lines = output.splitlines()
    best = max(data["keys"], key=lambda k: k["probability"])
    for side, title in (("query_sums", "query side at "), ("key_sums", "key side at ")):
        sums = [(s["component"], s["value"]) for s in best[side]]
        assert table(lines, title) == expected(sums, 8, "components")
        assert abs(math.fsum(v for _, v in sums) - best["score"]) < 1e-12 * max(1.0, abs(best["score"]))
    pairs = [(f"{t['query']} x {t['key']}", t["value"]) for t in best["terms"]]
    assert table(lines, f"top terms at key {best['position']} ") == expected(pairs, 8, "terms")


def contrast_of(data: dict, key: int, other: int) -> dict[str, list[tuple[str, float]]]:
    """Each side's split of score[key] - score[other], computed here from the file's per-key sums."""
    by = {k["position"]: k for k in data["keys"]}
    out = {}
    for side in ("query_sums", "key_sums"):
        diff = {s["component"]: s["value"] for s in by[key][side]}
        for s in by[other][side]:
            diff[s["component"]] = diff.get(s["component"], 0.0) - s["value"]
        out[side] = sorted(diff.items(), key=lambda x: (-abs(x[1]), x[0]))
    return out


def test_the_contrast_defaults_to_the_next_most_attended_key_and_adds_up(written: tuple[dict, str]) -> None:
    data, output = written
    lines = output.splitlines()
    first, second = sorted(data["keys"], key=lambda k: (-k["probability"], k["position"]))[:2]
    j, o = first["position"], second["position"]
    head = next(line for line in lines if line.startswith("contrast "))
    assert head.split(":")[0] == f"contrast     key {j} {data['tokens'][j]!r} against key {o} {data['tokens'][o]!r}"
    assert head.endswith(f"score difference {first['score'] - second['score']:.4g} "
                         f"({first['score']:.4g} - {second['score']:.4g})")
    want = contrast_of(data, j, o)
    at = lines.index(head)
    for side, title in (("query_sums", "query side, "), ("key_sums", "key side, ")):
        assert table(lines[at:], title) == expected(want[side], 8, "components")
        total = math.fsum(v for _, v in want[side])
        assert abs(total - (first["score"] - second["score"])) < 1e-12 * max(1.0, abs(first["score"]))


def test_the_explained_and_the_contrasted_key_are_chosen_by_option(llama_checkpoint: Path, tmp_path: Path,
                                                                    written: tuple[dict, str]) -> None:
    data, _ = written
    result = CliRunner().invoke(main, ["attention", str(llama_checkpoint), "-p", PROMPT, "--layer", "2", "--head",
                                       "1", "--neurons", "2", "--key", "3", "--contrast", "0", "--top", "3"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    by = {k["position"]: k for k in data["keys"]}
    assert table(lines, "query side at ") == expected([(s["component"], s["value"]) for s in by[3]["query_sums"]],
                                                      3, "components")
    at = lines.index(next(line for line in lines if line.startswith("contrast ")))
    assert lines[at].startswith(f"contrast     key 3 {data['tokens'][3]!r} against key 0 ")
    assert table(lines[at:], "key side, ") == expected(contrast_of(data, 3, 0)["key_sums"], 3, "components")


@pytest.mark.parametrize(("args", "message"), [
    (["--layer", "3", "--head", "0"], "Error: Expected a layer in [0, 2] (the model has 3 layers). Got 3."),
    (["--layer", "0", "--head", "4"], "Error: Expected a head in [0, 3]"),
    (["--layer", "0", "--head", "0", "--query", "40"], "Error: Expected a position in"),
    (["--layer", "0", "--head", "0", "--neurons", "-1"], "Error: Expected neurons to be a non-negative integer. "
                                                          "Got -1."),
    (["--layer", "0", "--head", "0", "--query", "3", "--contrast", "5"], "Error: Expected the other key to be a key "
                                                                        "position the query attends to (0 to 3"),
    (["--layer", "0", "--head", "0", "--query", "3", "--key", "5"], "Error: Expected the key to be a key position the "
                                                                   "query attends to (0 to 3"),
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
