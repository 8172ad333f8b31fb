"""Attention (QK) files and head loadings read strictly: a planted file beside a graph (a link to a device, a FIFO)
refused at once in one line, a file's model identity complete and its head one the model has, and head loadings only
on the layers a link crosses, complete there (damaged stored loadings raise, never read as "no layer crossed")."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from test_graph_heads import qk_file, small_graph
from timed import within

from detjac.cli.main import main
from detjac.errors import InvalidArgumentError
from detjac.view import GraphFile
from detjac.view.attention_file import check_belongs, parse_attention
from detjac.view.graph_page import graph_payload


@pytest.mark.parametrize("plant", ["device", "fifo"])
def test_a_planted_attention_file_is_refused_at_once_in_one_line(tmp_path, plant):
    (tmp_path / "g.json").write_text(json.dumps(small_graph()))
    planted = tmp_path / "g.qk.L2.H1.json"
    if plant == "device":
        planted.symlink_to("/dev/zero")
    else:
        os.mkfifo(planted)
    got = "a character device, not a regular file" if plant == "device" else "a FIFO (named pipe), not a regular file"
    out = within(10, lambda: GraphFile(tmp_path / "g.json"))
    assert isinstance(out.get("error"), InvalidArgumentError), out
    assert f"Got {planted}, which cannot be read as JSON ({got})" in str(out["error"])
    code, output = within(10, lambda: _view(str(tmp_path / "g.json"), "--export", str(tmp_path / "out")))["value"]
    assert code == 1 and got in output and "Traceback" not in output, output
    assert len(output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    planted.unlink()
    code, output = within(10, lambda: _view(str(tmp_path / "g.json"), "--attention", "/dev/zero", "--export",
                                            str(tmp_path / "out")))["value"]
    assert code == 1 and "Got /dev/zero, which cannot be read as JSON (a character device" in output, output
    assert not (tmp_path / "out").exists()


def test_an_attention_file_over_its_cap_is_refused_before_reading(tmp_path):
    from detjac.safe_json import ATTENTION_MAX_BYTES

    (tmp_path / "g.json").write_text(json.dumps(small_graph()))
    with open(tmp_path / "g.qk.L2.H1.json", "wb") as handle:  # sparse: its size, no data
        handle.truncate(ATTENTION_MAX_BYTES + 1)
    out = within(10, lambda: GraphFile(tmp_path / "g.json"))
    assert isinstance(out.get("error"), InvalidArgumentError), out
    assert "which cannot be read as JSON (a file of 1,073,741,825 bytes, more than the 1 GiB an attention file may " \
        "hold)" in str(out["error"])


def test_a_planted_or_oversized_graph_file_is_refused_before_reading(tmp_path):
    from detjac.safe_json import GRAPH_MAX_BYTES

    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    with open(tmp_path / "big.json", "wb") as handle:  # sparse: its size, no data
        handle.truncate(GRAPH_MAX_BYTES + 1)
    for name, got in (("fifo.json", "Got a file of neither kind."), ("zero.json", "Got a file of neither kind."),
                      ("big.json", f"a file of {GRAPH_MAX_BYTES + 1:,} bytes, more than the 4 GiB a graph JSON file "
                                   "may hold")):
        code, output = within(10, lambda name=name: _view(str(tmp_path / name), "--export", str(tmp_path / "out")))[
            "value"]
        assert code == 1 and got in output and len(output.strip().splitlines()) == 1, output
        assert not (tmp_path / "out").exists()


def _view(*args):
    result = CliRunner().invoke(main, ["view", *args])
    return result.exit_code, result.output


def _without(name):
    model = dict(qk_file()["model"])
    model.pop(name)
    return qk_file(model=model)


@pytest.mark.parametrize(("data", "message"), [
    (qk_file(model={}), "Expected the model of qk.json to record its family, model_type, name_or_path, dtype, "
                        "n_layers, n_heads, d_model .* Got no family."),
    (_without("n_heads"), "Got no n_heads."),
    (_without("model_type"), "Got no model_type."),
    (qk_file(model={**qk_file()["model"], "n_heads": 0}), "Got n_heads '0'."),
    (qk_file(model={**qk_file()["model"], "d_model": True}), "Got d_model 'True'."),
    (qk_file(head=99), "Expected head to be a non-negative integer below 4 in qk.json. Got '99'."),
    (qk_file(head=10**39), "Expected head to be a non-negative integer below 4 in qk.json. Got '1000000000000"),
    (qk_file(layer=4), "Expected layer to be a non-negative integer below 4 in qk.json. Got '4'."),
])
def test_an_attention_file_needs_its_whole_model_and_a_head_it_has(data, message):
    with pytest.raises(InvalidArgumentError, match=message):
        parse_attention(data, "qk.json")


@pytest.mark.parametrize(("info", "got"), [({"family": "Gemma3"}, "family Llama"),
                                           ({"model_type": "gemma3_text"}, "model_type llama"),
                                           ({"n_heads": 8}, "n_heads 4"), ({"d_model": 32}, "d_model 16")])
def test_an_attention_file_of_a_model_of_another_shape_is_refused_even_with_the_same_weights_digest(info, got):
    graph = small_graph(**info)  # same weights' SHA-256: the identity is compared all the same
    with pytest.raises(InvalidArgumentError, match=f"graph's model .* Got one of {got}"):
        check_belongs(parse_attention(qk_file(), "qk.json"), graph_payload(graph), graph["metadata"]["info"],
                      "qk.json")
    same = small_graph(family="Llama", model_type="llama", n_heads=4, d_model=16)
    check_belongs(parse_attention(qk_file(), "qk.json"), graph_payload(same), same["metadata"]["info"], "qk.json")


def _loaded(change, **info):
    """test_graph_heads' hand graph (one layer, two heads; n_layers given) with ``change`` made to its links."""
    from test_graph_heads import hand_loaded

    graph = hand_loaded()
    graph["metadata"]["info"].update(info)
    change(graph["links"])
    return graph


@pytest.mark.parametrize(("change", "info", "message"), [
    (lambda links: links[2].update(head_loadings={"0": {"0": 1.0, "1": 1.0, "skip": 1.0}}), {},
     r"the layers the link crosses \(no layer\) in the link 0_7_1 -> 2_9_1 of g.json. Got layers 0"),
    (lambda links: links[0].update(head_loadings={}), {},
     r"the layers the link crosses \(layers 0 to 0\) in the link E_1_0 -> 0_7_1 of g.json. Got none"),
    (lambda links: links[3].update(head_loadings={"0": {"0": 0.25, "1": 0.25, "skip": 0.5},
                                                  "1": {"0": 0.5, "1": 0.0, "skip": 0.5}}), {},
     r"\(layers 0 to 0\) in the link E_2_1 -> 2_9_1 of g.json. Got layers 0, 1"),
    (lambda links: links[0].update(head_loadings={"0": {"0": 1.5, "1": -0.5, "7": 0.0, "skip": 1.0}}), {"n_heads": 2},
     r"each head of the model \(0 to 1\) .* Got heads 0, 1, 7 at layer 0"),
    (lambda links: links[0].update(head_loadings={"0": {"0": 1.0, "skip": 1.0}}), {"n_heads": 2},
     r"each head of the model \(0 to 1\) .* Got heads 0 at layer 0"),
    (lambda links: links[3].update(head_loadings={"0": {"0": 0.25, "2": 0.25, "skip": 0.5}}), {},
     r"each head of the model \(0 to 1\) at every layer in the link E_2_1 -> 2_9_1 .* Got heads 0, 2 at layer 0"),
])
def test_head_loadings_only_on_crossed_layers_and_every_head_there(change, info, message):
    with pytest.raises(InvalidArgumentError, match=message):
        graph_payload(_loaded(change, **info), "g.json")


def test_head_loadings_on_every_head_of_every_crossed_layer_are_drawn():
    page = graph_payload(_loaded(lambda links: None, n_heads=2), "g.json")
    assert [x.get("heads") for x in page["links"]] == [
        [{"layer": 0, "top": [[0, 1.5], [1, -0.5]], "rest": 0, "n_rest": 0, "skip": 1.0}], None, [],
        [{"layer": 0, "top": [[0, 0.25], [1, 0.25]], "rest": 0, "n_rest": 0, "skip": 0.5}]]


def test_a_graph_records_its_model_s_heads_and_an_attention_file_of_other_heads_is_refused(graph):
    from detjac.view.attention_file import graph_token_ids
    from scripts.gcide import MODEL

    info = graph["metadata"]["info"]
    assert (info["n_heads"], info["d_model"], info["n_layers"]) == \
        (MODEL["num_attention_heads"], MODEL["hidden_size"], MODEL["num_hidden_layers"])
    page = graph_payload(graph)
    ids = graph_token_ids(page["nodes"])
    tokens = page["metadata"]["prompt_tokens"]
    model = {**qk_file()["model"], **{k: info[k] for k in ("family", "model_type", "n_layers", "d_model")},
             "source": info.get("model", "default")}
    model.pop("weights_sha256")
    ours = qk_file(tokens=tokens, token_ids=[ids[k] for k in range(len(tokens))], model=model)
    check_belongs(parse_attention(ours, "qk.json"), page, info, "qk.json")
    other = qk_file(tokens=tokens, token_ids=[ids[k] for k in range(len(tokens))], model={**model, "n_heads": 8})
    with pytest.raises(InvalidArgumentError, match="graph's model .* Got one of n_heads 8"):
        check_belongs(parse_attention(other, "qk.json"), page, info, "qk.json")
