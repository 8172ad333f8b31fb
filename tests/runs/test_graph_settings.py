"""The one graph-settings type: what a ``--graph`` store records of it (so stores written before resume with the same
prompt ids), what a run refuses of it, and its two spellings on the command line checked by its one check."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from store_helpers import write_prompts

from detjac.cli.main import main
from detjac.errors import InvalidArgumentError
from detjac.graph_settings import GraphSettings
from detjac.runs import RunOptions, run_corpus
from detjac.runs.description import RunDescription
from detjac.store import prompt_id

PROMPT = "The capital of France is"


def _described(graph: GraphSettings | None) -> RunDescription:
    return RunDescription("m", "m", None, "llama", "0" * 64, "Llama", "float64", "full", True, -1, (), None, None, 8,
                          detjac_version="0", graph=graph)


@pytest.mark.parametrize("graph, stored, pid", [
    # the ids and descriptions a store written before the settings became one type holds (computed then)
    (GraphSettings(max_nodes=50, heads=3), {"max_nodes": 50, "node_threshold": 0.8, "edge_threshold": 0.98,
                                            "heads": 3}, "2f78197931f3a3fe"),
    (GraphSettings(node_threshold=0.5, edge_threshold=0.9), {"max_nodes": 7500, "node_threshold": 0.5,
                                                             "edge_threshold": 0.9}, "d16b298c5f996399"),
    (None, None, "54b72e655cb0012b"),
])
def test_a_store_written_before_resumes_with_the_same_prompt_ids(graph, stored, pid):
    described = _described(graph).as_dict()
    assert described.get("graph") == stored and ("graph" in described) == (graph is not None)
    assert prompt_id(described, PROMPT) == pid


def test_how_a_graph_is_computed_is_not_part_of_its_identity():
    settings = GraphSettings(max_nodes=50, heads=3)
    assert GraphSettings(max_nodes=50, heads=3, rows_per_pass=7, heads_up_to=True).stored() == settings.stored()
    assert GraphSettings.of_stored(settings.stored()) == GraphSettings(max_nodes=50, heads=3, heads_up_to=True)


@pytest.mark.parametrize("settings, message", [
    (GraphSettings(max_logits=3), "Expected a run's graph settings among those its store records"),
    (GraphSettings(node_threshold=1.5), "Expected node_threshold in [0, 1]. Got 1.5."),
    (GraphSettings(max_nodes=0), "Expected max_nodes to be a positive integer. Got 0."),
])
def test_a_run_refuses_graph_settings_before_any_store(tmp_path, settings, message):
    prompts = write_prompts(tmp_path / "p.txt", [PROMPT])
    with pytest.raises(InvalidArgumentError) as refused:
        run_corpus("default", prompts, str(tmp_path / "s.zarr"), RunOptions(graph=settings))
    assert message in str(refused.value)
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.parametrize("command, flag", [("graph", "--node-threshold"), ("run", "--graph-node-threshold")])
def test_both_commands_name_their_own_flag_when_the_one_check_refuses(tmp_path, command, flag):
    prompts = write_prompts(tmp_path / "p.txt", [PROMPT])
    out = tmp_path / ("g.json" if command == "graph" else "s.zarr")
    args = (["graph", "-p", PROMPT, "--out", str(out)] if command == "graph"
            else ["run", "default", str(prompts), "--out", str(out), "--graph"])
    result = CliRunner().invoke(main, [*args, flag, "1.5"])
    assert result.exit_code == 2 and f"Expected {flag} in [0, 1]. Got 1.5." in result.output, result.output
    assert not out.exists()
