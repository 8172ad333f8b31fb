"""Everyday fit: token-id prompts in JSONL, the sample prompts files, `detjac jacobian --out`, progress off a
terminal (plain lines, no escapes), and a memory budget too small for one layer refused before any store."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from store_helpers import write_prompts

from detjac.cli.main import main
from detjac.engine import get_tokenizer, load_model
from detjac.errors import InvalidArgumentError, PromptsFileError
from detjac.model_settings import LoadSpec
from detjac.progress import PlainBar, tqdm
from detjac.runs.prompts import read_prompts
from detjac.runs.run import RunOptions, run_corpus
from detjac.store import open_store

ROOT = Path(__file__).resolve().parents[2]


def test_token_id_prompts_in_jsonl_store_the_same_jacobian_as_their_text(tmp_path: Path,
                                                                          llama_checkpoint: Path) -> None:
    ids = get_tokenizer(load_model(llama_checkpoint))("a b c")["input_ids"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b c"}) + "\n" + json.dumps({"prompt": ids, "source": "ids"}) + "\n")
    assert read_prompts(prompts).prompts[1].ids == tuple(ids)
    out = str(tmp_path / "run.zarr")
    assert run_corpus(str(llama_checkpoint), prompts, out, RunOptions()).summary.written == 2
    store = open_store(out)
    text, given = sorted(store, key=lambda p: p.attrs["line"])
    assert given.prompt == json.dumps(ids) and given.attrs["meta"] == {"source": "ids"}
    assert given.attrs["token_ids"] == text.attrs["token_ids"] == ids
    # the same ids through the same process and engine: the same bits
    np.testing.assert_array_equal(given.jacobian(lazy=False), text.jacobian(lazy=False))


@pytest.mark.parametrize("line", ['{"prompt": [1, "a"]}', '{"prompt": []}', '{"prompt": [true, 2]}',
                                  '{"prompt": 3}'])
def test_malformed_token_id_prompts_are_refused_naming_the_line(tmp_path: Path, line: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(PromptsFileError, match=r'or token ids, \{"prompt": \[1, 2, 3\]\}\) on line 2 of '):
        read_prompts(path)


def test_nan_and_infinity_in_a_prompts_file_are_refused_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    for bad in ("NaN", "Infinity", "-Infinity"):
        path.write_text('{"prompt": "fine"}\n{"prompt": "a b", "score": ' + bad + "}\n")
        with pytest.raises(PromptsFileError, match=f"on line 2 of .*Got invalid JSON: {bad}, which standard JSON"):
            read_prompts(path)


def test_json_a_parser_cannot_hold_in_a_prompts_line_is_refused_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    for bad, got in (("[" * 100_000 + "]" * 100_000, "values nested too deep to read"),
                     ('{"prompt": "a", "seed": ' + "7" * 5000 + "}", "an integer of 5000 digits"),
                     ('{"prompt": "a", "score": 1e400}', "the number 1e400, which is not finite")):
        path.write_text('{"prompt": "fine"}\n' + bad + "\n")
        with pytest.raises(PromptsFileError, match=f"on line 2 of .*Got {got}") as caught:
            read_prompts(path)
        assert "\n" not in str(caught.value)


def test_prompt_lines_end_at_newlines_only_and_the_format_comes_from_the_name(tmp_path: Path) -> None:
    odd = "one\x0cform feed\x85next line\u2028line separator\u2029paragraph\ra lone CR"  # none of these ends a line
    txt = tmp_path / "p.txt"
    txt.write_bytes(("\ufeff" + odd + "\r\nsecond\n\nthird").encode())
    got = read_prompts(txt)
    assert [(p.line, p.text) for p in got.prompts] == [(1, odd), (2, "second"), (4, "third")] and got.blank == 1
    for name in ("p.jsonl", "p.ndjson"):
        path = tmp_path / name
        path.write_text(json.dumps({"prompt": "a\u2028b", "id": 1}, ensure_ascii=False) + "\n{\"text\": \"c\"}\n")
        lines = read_prompts(path).prompts
        assert [(p.text, p.meta) for p in lines] == [("a\u2028b", {"id": 1}), ("c", {})]
    as_json = tmp_path / "p.json"
    as_json.write_text('{"prompt": "a"}\n')
    with pytest.raises(PromptsFileError, match=r"or its format given \(--prompts-format txt\|jsonl\). Got 'p.json'"):
        read_prompts(as_json)
    assert read_prompts(as_json, "jsonl").prompts[0].text == "a"
    assert read_prompts(as_json, "txt").prompts[0].text == '{"prompt": "a"}'


def test_the_sample_prompts_files_read_and_tokenize() -> None:
    tok = get_tokenizer(load_model("default"))
    for name in ("prompts.txt", "prompts.jsonl"):
        prompts = read_prompts(ROOT / "examples" / name)
        assert len(prompts.prompts) >= 3 and prompts.blank == 0
        for item in prompts.prompts:
            ids = list(item.ids) if item.ids is not None else tok(item.text)["input_ids"]
            assert 3 <= len(ids) <= 64


def test_jacobian_out_writes_an_npz_or_a_store(tmp_path: Path, llama_checkpoint: Path) -> None:
    runner = CliRunner()
    npz = tmp_path / "abc.npz"
    args = ["jacobian", str(llama_checkpoint), "-p", "a b c", "--k", "1", "--top", "1", "--out"]
    result = runner.invoke(main, [*args, str(npz)])
    assert result.exit_code == 0, result.output
    saved = np.load(npz)
    J, x, d = saved["jacobian"], saved["embeddings"], len(saved["output"])
    assert J.shape == (d, 4, d) and list(saved["tokens"]) == ["<s>", "a", " b", " c"]
    error = np.linalg.norm(np.einsum("rtc,tc->r", J, x) - saved["output"]) / np.linalg.norm(saved["output"])
    assert error < 1e-12 and float(saved["reconstruction_error"]) < 1e-12
    assert str(saved["model"]) == str(llama_checkpoint) and str(saved["prompt"]) == "a b c"
    zarr_out = tmp_path / "abc.zarr"
    result = runner.invoke(main, [*args, str(zarr_out)])
    assert result.exit_code == 0, result.output
    (prompt,) = list(open_store(zarr_out))
    assert f"stored as prompt {prompt.id} in {zarr_out}" in result.output
    np.testing.assert_array_equal(prompt.jacobian(lazy=False), J)  # the same command in this process: same bits
    bad = runner.invoke(main, [*args[:-1], "--out", str(tmp_path / "missing" / "x.npz")])
    assert bad.exit_code == 1 and "Expected an existing folder" in bad.output
    kept = npz.read_bytes()
    again = runner.invoke(main, [*args, str(npz)])
    assert again.exit_code == 1 and "exists (--force replaces it)" in again.output and npz.read_bytes() == kept
    assert runner.invoke(main, [*args, str(npz), "--force"]).exit_code == 0


def test_bars_off_a_terminal_are_plain_lines(tmp_path: Path, llama_checkpoint: Path) -> None:
    assert isinstance(tqdm(range(3)), PlainBar)  # stderr is captured here: not a terminal
    sink = io.StringIO()
    with PlainBar(desc="prompts", unit="prompt", total=4, interval=0, file=sink) as bar:
        for _ in range(4):
            bar.set_postfix(error="1e-15")
            bar.update()
    lines = sink.getvalue().splitlines()
    assert lines[0] == "prompts: 1/4 prompt (25%) in " + lines[0].split(" in ")[1]
    assert len(lines) == 4  # one per update (interval 0), and not the last one twice on close
    assert lines[-1].startswith("prompts: 4/4 prompt (100%)") and lines[-1].endswith(", error=1e-15")
    quiet = io.StringIO()
    with PlainBar(desc="blocks", leave=False, interval=3600, file=quiet) as inner:
        inner.update()
    assert quiet.getvalue() == ""  # an inner bar leaves nothing, and writes nothing between intervals
    result = CliRunner().invoke(main, ["run", str(llama_checkpoint), str(write_prompts(tmp_path / "p.txt", ["a b"])),
                                       "--out", str(tmp_path / "r.zarr")])
    assert result.exit_code == 0, result.output
    assert "\r" not in result.output and "\x1b" not in result.output and "Loading weights" not in result.output
    assert "prompts: 1/1 prompt (100%)" in result.output


def test_a_memory_budget_below_one_layer_is_refused_before_a_store_exists(tmp_path: Path,
                                                                          llama_checkpoint: Path) -> None:
    out = tmp_path / "r.zarr"
    with pytest.raises(InvalidArgumentError, match="raise --max-memory"):
        run_corpus(str(llama_checkpoint), write_prompts(tmp_path / "p.txt", ["a b"]), str(out),
                   RunOptions(load=LoadSpec(max_memory="cpu=1KiB")))
    assert not out.exists()
