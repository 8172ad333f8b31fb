"""``detjac attention --graph G --top-heads N``: the attention files of the first N heads of G's heads panel, each at
G's target position, written beside G (where ``detjac view G`` finds them) after loading the model once, each the
same file ``detjac attention --layer --head`` writes; bad input refused in one line before the model loads, and
nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import detjac.engine
from detjac.cli.main import main
from detjac.view import GraphFile

PROMPT = "Copper, n. A"


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def graph(tmp_path_factory) -> Path:
    """A graph of the default model with head loadings on its 8 strongest links (read only: tests copy it)."""
    out = tmp_path_factory.mktemp("graph") / "g.json"
    result = invoke("graph", "-p", PROMPT, "--max-nodes", "40", "--heads", "8", "--out", str(out))
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def loads(monkeypatch) -> list[object]:
    """Every model load of the command (detjac.engine.load_engine), counted."""
    calls: list[object] = []
    real = detjac.engine.load_engine

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(detjac.engine, "load_engine", counted)
    return calls


def copy(graph: Path, folder: Path) -> Path:
    shutil.copy(graph, folder / "g.json")
    return folder / "g.json"


def test_the_top_heads_files_are_written_beside_the_graph_in_one_model_load(graph, tmp_path, loads):
    g = copy(graph, tmp_path)
    rows = GraphFile(g).data("graph")["metadata"]["heads"]["rows"]
    target = next(n["ctx_idx"] for n in json.loads(g.read_text())["nodes"] if n["feature_type"] == "logit")
    result = invoke("attention", "--graph", str(g), "--top-heads", "3", "--heads-by", "share")
    assert result.exit_code == 0, result.output
    assert len(loads) == 1
    heads = [(r["layer"], r["head"]) for r in rows[:3]]
    written = sorted(p.name for p in tmp_path.glob("g.qk.*.json"))
    assert written == sorted(f"g.qk.L{layer}.H{head}.json" for layer, head in heads)
    assert result.output.splitlines()[-3:] == [f"wrote        {tmp_path / f'g.qk.L{layer}.H{head}.json'} (layer "
                                               f"{layer} head {head})" for layer, head in heads]
    layer, head = heads[0]
    single = tmp_path / "single.json"
    result = invoke("attention", "-p", PROMPT, "--layer", str(layer), "--head", str(head), "--query", str(target),
                    "--out", str(single))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / f"g.qk.L{layer}.H{head}.json").read_text()) == json.loads(single.read_text())
    single.unlink()
    pages = GraphFile(g)  # the viewer links each written head to its page
    linked = {(r["layer"], r["head"]): r["page"] for r in pages.data("graph")["metadata"]["heads"]["rows"]}
    assert [linked[h] for h in heads] == [f"attention/{layer}.{head}.{target}" for layer, head in heads]


def test_by_default_the_heads_of_largest_direct_effect_get_their_files(graph, tmp_path, loads):
    g = copy(graph, tmp_path)
    effects = json.loads(g.read_text())["metadata"]["info"]["head_effects"]["values"][0]  # (layers, heads)
    ranked = sorted(((abs(v), layer, head) for layer, row in enumerate(effects) for head, v in enumerate(row)),
                    reverse=True)
    result = invoke("attention", "--graph", str(g), "--top-heads", "2")
    assert result.exit_code == 0, result.output
    assert "heads ranked by |direct effect| on the target" in result.output
    assert sorted(p.name for p in tmp_path.glob("g.qk.*.json")) == sorted(
        f"g.qk.L{layer}.H{head}.json" for _, layer, head in ranked[:2])


def test_a_folder_given_with_out_gets_the_files(graph, tmp_path, loads):
    g = copy(graph, tmp_path)
    (tmp_path / "pages").mkdir()
    result = invoke("attention", "--graph", str(g), "--top-heads", "1", "--out", str(tmp_path / "pages"))
    assert result.exit_code == 0, result.output
    assert [p.name for p in (tmp_path / "pages").iterdir()] == [next(tmp_path.glob("pages/g.qk.L*.json")).name]


@pytest.mark.parametrize(("args", "message"), [
    (["--top-heads", "2", "--heads-by", "share"], "Error: Expected a new file. Got "),  # one exists: refused first
    (["--top-heads", "2", "--heads-by", "share", "--out", "nowhere"],
     "Error: Expected an existing folder for the attention files. Got "),
])
def test_bad_input_is_refused_before_the_model_loads(graph, tmp_path, loads, args, message):
    g = copy(graph, tmp_path)
    rows = GraphFile(g).data("graph")["metadata"]["heads"]["rows"]
    planted = tmp_path / f"g.qk.L{rows[1]['layer']}.H{rows[1]['head']}.json"
    planted.write_text("{}")
    args = [a if a != "nowhere" else str(tmp_path / "nowhere") for a in args]
    result = invoke("attention", "--graph", str(g), *args)
    assert result.exit_code != 0 and result.output.strip().startswith(message), result.output
    assert len(result.output.strip().splitlines()) == 1 and loads == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["g.json", planted.name])
    assert planted.read_text() == "{}"


def test_a_head_named_with_a_graph_is_a_usage_error(graph, tmp_path, loads):
    result = invoke("attention", "--graph", str(copy(graph, tmp_path)), "--layer", "0")
    assert result.exit_code == 2 and loads == []
    assert result.output.strip().splitlines()[-1] == "Error: Expected no --layer, --head, --key or --contrast with " \
        "--graph: its heads panel picks the heads."
    result = invoke("attention", "-p", PROMPT, "--layer", "0")
    assert result.exit_code == 2 and result.output.strip().splitlines()[-1] == "Error: Expected --layer, --head " \
        "and a prompt (--prompt or --prompt-file), or --graph G.json (with --top-heads). Got a part of them."


def test_a_graph_without_head_loadings_and_another_prompt_are_refused_by_name(graph, tmp_path, loads):
    bare = json.loads(graph.read_text())
    for link in bare["links"]:
        link.pop("head_loadings", None)
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    result = invoke("attention", "--graph", str(tmp_path / "bare.json"), "--heads-by", "share")
    assert result.output.strip() == f"Error: Expected a graph that ranks its heads (logits, and head loadings: " \
        f"`detjac graph --heads N`) in {tmp_path / 'bare.json'}. Got no head loadings on its " \
        f"{len(bare['links'])} links." and loads == []
    del bare["metadata"]["info"]["head_effects"]  # a graph written before the heads' direct effects
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    result = invoke("attention", "--graph", str(tmp_path / "bare.json"))
    assert result.output.strip().startswith("Error: Expected a graph that ranks its heads (logits, and the heads' "
                                            "direct effects)") and "--heads-by share" in result.output
    g = copy(graph, tmp_path)
    result = invoke("attention", "--graph", str(g), "-p", "Copper, n. B")
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1] == (
        "Error: Expected the graph's prompt (8 tokens, '<s>Copper, n. A') for its heads' attention files. Got 8 "
        "tokens, '<s>Copper, n. B'."), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare.json", "g.json"]


def test_graph_attention_pages_writes_the_same_files_with_the_graphs_own_model_load(graph, tmp_path, loads):
    """``detjac graph --attention-pages N``: the graph and its first N heads' attention files from one model load,
    each file equal to what ``detjac attention --graph`` writes beside the same graph."""
    out = tmp_path / "g.json"
    result = invoke("graph", "-p", PROMPT, "--max-nodes", "40", "--heads", "8", "--out", str(out),
                    "--attention-pages", "2")
    assert result.exit_code == 0, result.output
    assert len(loads) == 1
    written = sorted(tmp_path.glob("g.qk.L*.H*.json"))
    assert len(written) == 2
    again = tmp_path / "again"
    again.mkdir()
    g = copy(out, again)
    assert invoke("attention", "--graph", str(g), "--top-heads", "2").exit_code == 0
    for path in written:
        ours, theirs = json.loads(path.read_text()), json.loads((again / path.name).read_text())
        assert ours["keys"] == theirs["keys"] and ours["layer"] == theirs["layer"] and ours["head"] == theirs["head"]


@pytest.mark.parametrize("args, message", [
    (("--attention-pages", "2", "--heads", "4", "--streamed"), "Expected no --streamed with --attention-pages"),
])
def test_graph_attention_pages_bad_options_are_refused_before_the_model_loads(tmp_path, loads, args, message):
    result = invoke("graph", "-p", PROMPT, "--max-nodes", "40", "--out", str(tmp_path / "g.json"), *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not loads and not list(tmp_path.iterdir())
