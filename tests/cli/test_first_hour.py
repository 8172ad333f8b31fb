"""What a new user meets in the first hour: device errors before anything loads, results that print short and
explain themselves, the API taking the CLI's model names, one message for a too-long prompt, a resumed run that
says it computed nothing, and low-rank stores analyzed where their triplets suffice."""

from __future__ import annotations

import hashlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.engine import InMemoryEngine, StreamedEngine, jacobian, load_engine, load_model
from detjac.engine.memory import check_device
from detjac.engine.tools.triplets import explain
from detjac.errors import InvalidArgumentError
from detjac.store import open_store


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA: the CPU-only messages do not apply")
@pytest.mark.parametrize("device", ["cuda", "cuda:3", "mps"])
def test_a_device_this_pytorch_lacks_is_one_line_before_anything_loads(device, monkeypatch):
    import detjac.engine.checkpoints.loading as loading

    monkeypatch.setattr(loading, "read_checkpoint", lambda *a, **k: pytest.fail("the model started loading"))
    result = invoke("jacobian", "default", "-p", "The cat", "--device", device)
    assert result.exit_code == 1 and "Traceback" not in result.output
    line = result.output.strip()
    assert "\n" not in line and line.startswith(f"Error: Expected a device this PyTorch can compute on (cpu). Got "
                                                f"'{device}'")
    if device.startswith("cuda") and torch.version.cuda is None:
        assert "CPU-only build" in line and "TORCH_SPEC=" in line
    with pytest.raises(InvalidArgumentError, match="Expected a device this PyTorch can compute on"):
        load_engine("default", streamed=True, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA")
def test_a_budget_for_a_device_this_machine_lacks_says_so(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"Got 'cuda:0'.*(CPU-only build|sees no CUDA device)"):
        StreamedEngine("default", max_memory="cuda:0=8GiB")
    assert check_device("CPU") == "cpu"
    with pytest.raises(InvalidArgumentError, match="Expected a torch device such as cpu, cuda or cuda:1. Got 'tpu'"):
        check_device("tpu")


def test_the_api_takes_the_cli_model_names():
    assert load_model("default").config.model_type == "llama"
    assert load_engine("default").n_layers == load_engine("default", streamed=True).n_layers == 4
    assert StreamedEngine("default").d_model == 256


def test_every_result_prints_short_and_says_what_it_is():
    lm = load_model("default")
    result = jacobian(InMemoryEngine(lm), "The cat sat")
    text = repr(result)
    assert len(text) < 300 and "\n" not in text
    assert re.search(r"llama .*'The cat sat': 4 tokens, jacobian \(256, 4, 256\) float64, detached, reconstruction "
                     r"error \d\.\d\de-\d\d", text)
    assert result._repr_html_().startswith("<table>") and "reconstruction error" in result._repr_html_()
    expl = explain(result, lm, k=2, top=3)
    assert len(repr(expl)) < 300 and "print() it" in repr(expl)
    printed = str(expl)
    assert printed.startswith("  combined [J_1 ... J_n] (256 x 1024); top singular values:")
    assert "#1 sigma" in printed and "per token J_k" in printed and len(printed.splitlines()) == 1 + 4 + 1 + 4 * 3
    assert "<table" in expl._repr_html_() and "&lt;" not in repr(expl)


def test_the_cli_and_str_of_an_explanation_are_the_same_table(tmp_path):
    result = invoke("demo", "-p", "The cat sat", "--k", "2", "--top", "3", "--plot", str(tmp_path / "d.png"))
    assert result.exit_code == 0, result.output
    lm = load_model("default")
    expl = explain(jacobian(InMemoryEngine(lm), "The cat sat"), lm, k=2, top=3)
    assert str(expl) in result.output


def test_a_too_long_prompt_gives_detjacs_message_alone():
    long = " ".join(["word"] * 700)
    done = subprocess.run([sys.executable, "-m", "detjac.cli.main", "jacobian", "default", "-p", long],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "Token indices sequence length" not in done.stderr + done.stdout
    assert (done.stdout + done.stderr).count("Expected a prompt of at most 256 tokens") == 1


def test_a_resumed_run_with_nothing_to_do_says_so(tmp_path: Path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The oak tree\n")
    out = str(tmp_path / "r.zarr")
    first = invoke("run", "default", str(prompts), "--out", out)
    assert first.exit_code == 0 and "worst reconstruction error this run" in first.output
    again = invoke("run", "default", str(prompts), "--out", out)
    assert again.exit_code == 0 and "0.00e+00" not in again.output
    worst = open_store(out).get(open_store(out).prompt_ids()[0]).attrs["reconstruction_error"]
    assert (f"no prompt computed this run (worst reconstruction error recorded in the store {worst:.2e}; "
            "`detjac store verify` recomputes)") in again.output


def test_a_low_rank_store_is_analyzed_where_its_triplets_suffice(tmp_path: Path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The oak tree\nA cat sat on\n")
    out = str(tmp_path / "lr.zarr")
    assert invoke("run", "default", str(prompts), "--out", out, "--keep", "rank:4").exit_code == 0
    store = open_store(out)
    for command in ("svd", "decode"):
        result = invoke("analyze", command, out, "--k", "3")
        assert result.exit_code == 0, result.output
        assert result.output.count("#1 sigma") == 2
    pid = store.prompt_ids()[0]
    stored = store.get(pid).triplets()[1]
    assert f"#1 sigma {stored[0]:<9.4g}" in invoke("analyze", "svd", out, "--k", "1", "--prompt-id", pid).output
    too_many = invoke("analyze", "svd", out, "--k", "5")
    assert too_many.exit_code == 1 and "Expected k <= 4" in too_many.output
    for command in ("dims", "report"):
        refused = invoke("analyze", command, out)
        assert refused.exit_code == 1 and "a low-rank store (--keep rank:4" in refused.output
        assert "detjac run MODEL PROMPTS --out FULL.zarr" in refused.output and "0/2" not in refused.output
        assert "low-rank store" in invoke("analyze", command, "--help").output


ONE_PROMPT_COMMANDS = (["jacobian"], ["svd"], ["steer"], ["demo"], ["lens", "apply"])
SHARED = ("prompt_texts", "prompt_files", "dtype", "device", "streamed", "max_memory", "revision", "trust_remote_code",
          "gguf_file")


def _command(words: list[str]):
    command = main
    for word in words:
        command = command.commands[word]
    return command


def test_the_one_prompt_commands_share_one_option_set():
    """The prompt and model options of jacobian, svd, steer, demo and lens apply are one definition: the same
    names, flags and help everywhere (steer's default dtype is float32, it generates; demo's prompts repeat); lens
    apply lists only those it accepts (never one it then refuses)."""
    seen = {}
    for words in ONE_PROMPT_COMMANDS:
        params = {p.name: p for p in _command(words).params}
        accepted = [n for n in SHARED if words != ["lens", "apply"] or n not in ("dtype", "streamed")]
        assert set(accepted) <= set(params), (words, set(accepted) - set(params))
        assert words != ["lens", "apply"] or not {"dtype", "streamed"} & set(params)
        for name in accepted:
            p = params[name]
            same = (tuple(p.opts),) if name.startswith("prompt") else (tuple(p.opts), p.help, p.default)
            seen.setdefault(name, set()).add(same if name != "dtype" else same[:2])
    assert {name: len(forms) for name, forms in seen.items()} == dict.fromkeys(SHARED, 1)
    assert "-p" in seen["prompt_texts"].pop()[0]


def test_a_prompt_file_works_wherever_a_prompt_does(tmp_path: Path):
    text = "Kitten, n. A young"
    (tmp_path / "p.txt").write_text(text + "\n", encoding="utf-8")
    runner = CliRunner()

    def lines(*args: str) -> list[str]:
        result = runner.invoke(main, ["jacobian", *args, "--k", "2"])
        assert result.exit_code == 0, result.output
        return [line.split("   (")[0] for line in result.stdout.splitlines()]  # the bars (stderr) aside

    assert lines("--prompt-file", str(tmp_path / "p.txt")) == lines("-p", text)
    both = runner.invoke(main, ["jacobian", "-p", text, "--prompt-file", str(tmp_path / "p.txt")])
    assert both.exit_code == 2 and "Expected exactly one of --prompt and --prompt-file. Got 2." in both.output
    svd = runner.invoke(main, ["svd", "--prompt-file", str(tmp_path / "missing.txt")])
    assert svd.exit_code != 0 and "Expected a readable UTF-8 text file for --prompt-file" in svd.output
    demo = runner.invoke(main, ["demo", "--prompt-file", str(tmp_path / "p.txt"), "--plot", str(tmp_path / "d.png")])
    assert demo.exit_code == 0 and f"[1] {text!r}" in demo.output and "[2]" not in demo.output


def test_an_option_a_command_cannot_honour_is_refused_by_name():
    runner = CliRunner()
    steer = runner.invoke(main, ["steer", "--concept-from", "c.zarr:0123456789abcdef", "--layer", "1", "-p", "x",
                                 "--streamed"])
    assert steer.exit_code == 2 and "Expected no --streamed with detjac steer: steering generates text" in steer.output
    apply = runner.invoke(main, ["lens", "apply", "missing.lens", "-p", "x", "--dtype", "float32"])
    assert apply.exit_code == 2 and "No such option '--dtype'" in apply.output  # its --help does not list it


def test_ids_become_text_one_way_in_results_explain_the_store_and_the_cli(tmp_path: Path):
    """An engine's result, ``explain`` on an engine, a stored prompt and the CLI turn ids into the
    same text; a result's tokens are text (they join back into the prompt), never ids or byte-level BPE pieces."""
    from detjac.analysis import piece_reader
    from detjac.engine import jacobian

    prompt = "Bread, n. An article"
    engine = load_engine("default")
    res = jacobian(engine, prompt)
    assert "".join(res.tokens[1:]) == prompt and res.tokens[0] == "<s>" and " n" in res.tokens
    assert not any(t.startswith(("Ġ", "▁")) for t in res.tokens)
    assert res.next_token == engine.tokenizer.decode([res.next_token_id])
    assert f"next token {res.next_token!r}" in repr(res) and "next token id" not in repr(res)
    printed = str(explain(res, engine, k=2, top=3))
    assert re.search(r"#1 sigma \S+\s+left -> '.+' '.+' '.+'$", printed, re.M), printed
    assert f"{res.tokens[-1]!r} sigma" in printed  # per-token labels are texts, not ids
    lm = load_model("default")
    assert printed == str(explain(jacobian(InMemoryEngine(lm), prompt), lm, k=2, top=3))
    (tmp_path / "p.txt").write_text(prompt + "\n")
    out = str(tmp_path / "r.zarr")
    assert invoke("run", "default", str(tmp_path / "p.txt"), "--out", out).exit_code == 0
    store = open_store(out)
    attrs = store.get(store.prompt_ids()[0]).attrs
    assert attrs["tokens"] == res.tokens and attrs["next_token"] == res.next_token
    text = piece_reader(store)
    assert [text(i) for i in res.token_ids] == [repr(t) for t in res.tokens]
    cli = invoke("jacobian", "default", "-p", prompt, "--k", "1")
    assert f"tokens      {len(res.tokens)}: " + " ".join(map(repr, res.tokens)) in cli.output


def test_a_refused_resume_names_the_setting_in_the_words_the_user_set(tmp_path: Path):
    """A resume refused for other settings says which options differ, as they are typed."""
    (tmp_path / "p.txt").write_text("The oak tree\n")
    out = str(tmp_path / "r.zarr")
    assert invoke("run", "default", str(tmp_path / "p.txt"), "--out", out).exit_code == 0
    refused = invoke("run", "default", str(tmp_path / "p.txt"), "--out", out, "--dtype", "float32", "--ordinary")
    assert refused.exit_code == 1
    assert ("In the settings you give: --dtype float32 here, --dtype float64 in the store; --ordinary here, "
            "no --ordinary in the store. Use --force-new to replace it, or another --out.") in refused.output


@pytest.mark.slow
def test_one_gguf_file_has_one_run_identity_whichever_engine_reads_it(tmp_path: Path):
    """A store begun on a GGUF file by one engine is resumed by the other (same ids, same run)."""
    from real_models import smollm2_path

    from detjac.engine.checkpoints.reference import resolve_model
    from detjac.runs.description import describe_run

    path = smollm2_path()
    source = resolve_model(str(path))
    engines = [load_engine(source, streamed=streamed) for streamed in (False, True)]
    runs = [describe_run(engine, str(path), Path(source), None, "float64", None, 64) for engine in engines]
    assert runs[0].config_sha256 == runs[1].config_sha256
    # the streamed engine's identity is the one stores already hold: their prompts keep their ids
    assert runs[1].config_sha256 == hashlib.sha256(engines[1].config.to_json_string().encode()).hexdigest()
    from detjac.store import prompt_id

    assert prompt_id(runs[0].as_dict(), "Hi") == prompt_id(runs[1].as_dict(), "Hi")


def test_ctrl_c_in_one_process_exits_130_with_the_prompts_kept(tmp_path: Path, monkeypatch):
    """Ctrl-C during a one-process run is told from an error (exit 130, as --help says), keeps the
    committed prompts, says how many, and the same command resumes."""
    import detjac.runs.local as local

    real, calls = local.write_one, []

    def interrupted_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(local, "write_one", interrupted_second)
    (tmp_path / "p.txt").write_text("The oak tree\nA cat sat on\nKitten, n. A young\n")
    out = str(tmp_path / "r.zarr")
    stopped = invoke("run", "default", str(tmp_path / "p.txt"), "--out", out)
    assert stopped.exit_code == 130, stopped.output
    assert "Aborted!" not in stopped.output
    assert f"interrupted: 1 prompt kept in {out}; run the same command again to resume." in stopped.output
    assert len(open_store(out).prompt_ids()) == 1
    monkeypatch.setattr(local, "write_one", real)
    resumed = invoke("run", "default", str(tmp_path / "p.txt"), "--out", out)
    assert resumed.exit_code == 0 and "1 already in" in resumed.output and "2 to compute" in resumed.output


def _every_command(group=main, path=()):
    yield path, group
    for name, command in getattr(group, "commands", {}).items():
        yield from _every_command(command, (*path, name))


def _garbled(text: str) -> list[str]:
    """Where help text, as click keeps it (dedented), will not render as written: a prose line that starts with
    spaces or holds a run of them (a real line break inside the docstring, e.g. an unescaped ``\\n``, leaves the
    rest indented), or a verbatim ``\\b`` block whose first line is indented."""
    bad = []
    for paragraph in text.split("\n\n"):
        lines = paragraph.split("\n")
        if lines[0].strip() == "\b":
            bad += [f"indented verbatim block: {lines[1]!r}"] if len(lines) > 1 and lines[1][:1].isspace() else []
            continue
        bad += [f"{line!r}" for line in lines if line[:1].isspace() or re.search(r"\S {2,}\S", line)]
    return bad


def test_every_commands_help_renders_as_written():
    """The help of every command and option renders as written (no line broken mid-sentence,
    no runs of spaces, examples aligned), and --help works for each."""
    bad = {}
    for path, command in _every_command():
        texts = [inspect.cleandoc(command.help or ""), *(getattr(p, "help", None) or "" for p in command.params)]
        if found := [line for text in texts for line in _garbled(text)]:
            bad[" ".join(path) or "detjac"] = found[:3]
        result = invoke(*path, "--help")
        assert result.exit_code == 0 and "Usage: " in result.output, (path, result.output)
    assert not bad, bad
    shown = invoke("run", "--help").output
    assert "Lines end at \\n (or \\r\\n) only" in " ".join(shown.split())
    assert "\n  Examples:\n    detjac run default prompts.txt --out run.zarr\n" in shown


def test_a_prompt_id_is_prompt_id_and_model_an_argument(tmp_path: Path):
    """--prompt is prompt text everywhere; where a command takes a stored prompt's id the option is --prompt-id (the
    old spelling --prompt is refused there, as --model is: MODEL is every command's argument); a default is never an
    error (decode on a rank-4 store)."""
    (tmp_path / "p.txt").write_text("The oak tree\nA cat sat on\n")
    out = str(tmp_path / "lr.zarr")
    assert invoke("run", "default", str(tmp_path / "p.txt"), "--out", out, "--keep", "rank:4").exit_code == 0
    pid = open_store(out).prompt_ids()[1]
    for words in (["analyze", "svd"], ["analyze", "decode"], ["analyze", "columns"], ["analyze", "image"],
                  ["analyze", "dims"], ["analyze", "layers"], ["analyze", "path"], ["view"]):
        options = {o for p in _command(words).params for o in p.opts}
        assert "--prompt-id" in options and "--prompt" not in options, words
    new = invoke("analyze", "svd", out, "--prompt-id", pid)
    old = invoke("analyze", "svd", out, "--prompt", pid)
    assert new.exit_code == 0 and new.output.count("#1 sigma") == 1
    assert old.exit_code == 2 and "No such option '--prompt'" in old.output
    decoded = invoke("analyze", "decode", out, "--prompt-id", pid)  # the default --k on a rank-4 store
    assert decoded.exit_code == 0 and decoded.output.count("sigma") >= 4 and "#5 sigma" not in decoded.output
    assert [p.name for p in _command(["demo"]).params if p.param_type_name == "argument"] == ["model"]
    flagged = invoke("demo", "--model", "default", "-p", "The cat", "--k", "1", "--plot", str(tmp_path / "d.png"))
    assert flagged.exit_code == 2 and "No such option" in flagged.output and "--model" in flagged.output


@pytest.mark.parametrize("streamed", [False, True])
def test_one_bar_per_unit_of_work_and_none_for_nothing(tmp_path: Path, monkeypatch, streamed: bool):
    """A prompt's blocks are counted by one bar (not the run's and the engine's side by side), and
    a run with nothing to do, or an export refused, prints no empty bar."""
    monkeypatch.setenv("DETJAC_PROGRESS_INTERVAL", "0")  # every update a line: the bars as they are
    (tmp_path / "p.txt").write_text("The oak tree\n")
    out = str(tmp_path / "r.zarr")
    first = invoke("run", "default", str(tmp_path / "p.txt"), "--out", out, *(["--streamed"] if streamed else []))
    assert first.exit_code == 0, first.output
    counts = [line.split()[1] for line in first.output.splitlines() if line.startswith("blocks:")]
    assert counts and len(counts) == len(set(counts)), counts  # one bar: each count once
    assert "row blocks:" not in first.output
    again = invoke("run", "default", str(tmp_path / "p.txt"), "--out", out, *(["--streamed"] if streamed else []))
    assert again.exit_code == 0 and "prompts:" not in again.output and "blocks:" not in again.output
    refused = invoke("view", out, "--export", str(tmp_path / "e"), "--prompt-id", "0123456789abcdef")
    assert refused.exit_code != 0 and "export:" not in refused.output


def _make(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(["make", "-C", str(root), "install", f"VENV={tmp_path / 'venv'}", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(subprocess.run(["sh", "-c", "command -v make"], capture_output=True).returncode != 0,
                    reason="no make on this machine")
def test_make_install_notices_a_different_torch_spec(tmp_path: Path):
    """The CUDA message's `make install TORCH_SPEC=...` reinstalls PyTorch on an existing venv (it
    said "Nothing to be done"); the same spec again does nothing. A fake venv python records what make runs."""
    log = tmp_path / "pip.log"
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    python.chmod(0o755)
    assert _make(tmp_path).returncode == 0  # a fresh venv: PyTorch, then detjac; the spec recorded
    assert "--force-reinstall" not in log.read_text() and "install --quiet torch==2.13.0" in log.read_text()
    log.write_text("")
    assert _make(tmp_path).returncode == 0 and log.read_text() == ""  # installed: nothing runs again
    cuda = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
    done = _make(tmp_path, f"TORCH_SPEC={cuda}")
    assert done.returncode == 0, done.stderr
    assert f"pip install --quiet --force-reinstall {cuda}" in log.read_text()
    assert (tmp_path / "venv" / ".detjac-torch-spec").read_text() == cuda
    log.write_text("")
    assert _make(tmp_path, f"TORCH_SPEC={cuda}").returncode == 0 and "torch" not in log.read_text()


def test_a_budget_too_small_is_told_in_units_that_show_the_numbers():
    """Sizes are written in a unit that shows them (not "0.0 MiB", "0.00 GiB")."""
    from detjac.engine.memory import format_bytes

    assert [format_bytes(n) for n in (512, 3 * 2**10, 2**20, int(1.5 * 2**30))] == ["512 B", "3.0 KiB", "1.0 MiB",
                                                                                 "1.50 GiB"]
    result = invoke("jacobian", "default", "-p", "The cat", "--max-memory", "cpu=1MiB")
    assert result.exit_code == 1 and "Expected a memory budget that holds two layers" in result.output
    assert "read ahead" in result.output and " in all. Got 1.0 MiB" in result.output
    assert " 0.0 MiB" not in result.output and "0.00 GiB" not in result.output
    assert re.search(r"Got 1\.0 MiB for cpu", result.output), result.output
