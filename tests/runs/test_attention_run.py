"""``detjac.runs.attention_pages``: several heads' attention files in one model load, each the file its attribution
writes for that head, named as the viewer finds them beside a graph; every refusal (a head the model lacks, a file
that exists, another prompt than the graph's) comes before anything is written."""

from __future__ import annotations

import json

import pytest

from detjac.engine import load_engine, qk_attribution
from detjac.errors import InvalidArgumentError
from detjac.runs import attention_pages

PROMPT = "Copper, n. A"


@pytest.fixture(scope="module")
def engine():
    return load_engine("default")


def test_each_head_s_file_is_the_one_its_attribution_writes(engine, tmp_path):
    paths = attention_pages(engine, PROMPT, [(3, 1), (2, 0), (3, 1)], tmp_path, stem="g", query=-2,
                            progress=False)
    assert [p.name for p in paths] == ["g.qk.L3.H1.json", "g.qk.L2.H0.json"]  # in order, each once
    for path, (layer, head) in zip(paths, [(3, 1), (2, 0)], strict=True):
        want = qk_attribution(engine, PROMPT, layer, head, query=-2).write(tmp_path / "want.json", force=True)
        assert json.loads(path.read_text()) == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.qk.L2.H0.json", "g.qk.L3.H1.json", "want.json"]


@pytest.mark.parametrize(("heads", "kwargs", "message"), [
    ([(1, 0), (4, 0)], {}, r"^Expected a layer in \[0, 3\] \(the model has 4 layers\)\. Got 4\.$"),
    ([(1, 0), (1, 4)], {}, r"^Expected a head in \[0, 3\]"),
    ([(1, 0), (2, 1)], {"tokens": ["<s>", "Cop", "per"]}, r"^Expected the graph's prompt \(3 tokens, '<s>Copper'\) for "
                                                          r"its heads' attention files\. Got 8 tokens"),
    ([], {}, r"^Expected at least one head"),
    ([(2, 1), (1, 0)], {"planted": True}, r"^Expected a new file\. Got .*g\.qk\.L1\.H0\.json, which exists"),
])
def test_a_refusal_comes_before_anything_is_written(engine, tmp_path, heads, kwargs, message):
    planted = kwargs.pop("planted", False)
    if planted:
        (tmp_path / "g.qk.L1.H0.json").write_text("{}")
    with pytest.raises(InvalidArgumentError, match=message):
        attention_pages(engine, PROMPT, heads, tmp_path, stem="g", progress=False, **kwargs)
    assert [p.name for p in tmp_path.iterdir()] == (["g.qk.L1.H0.json"] if planted else [])
