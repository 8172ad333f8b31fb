"""The examples of the documentation pages, found and run: every Python snippet and every CLI command.

A page's fenced blocks are its examples: a ``python`` block is run as Python (the blocks of one page in one
namespace, in page order); in any other block, each line starting with ``$ `` is a shell command (a line ending
in ``\\`` goes on), and so is each line starting with ``detjac `` in a block of no language or ``bash``/``console``.
The lines after a command, up to the next one, are its shown output. A block is not run when the line before its
fence (blank lines apart) says why: ``<!-- docs: not run: REASON -->`` (the test lists these, so none hides). A block
after ``<!-- docs: printed by the python block above -->`` is what the Python block before it prints: checked as a
command's shown output is, so a page cannot show text its code no longer prints.

Examples name models and files a reader has and this machine may not: each runs as written after the
substitutions of :data:`SUBSTITUTIONS` (a hub id resolves from a Hugging Face cache whose snapshot is the
shipped model, a CUDA device becomes the CPU, ...), in a fresh folder holding the files the pages name
(:func:`sandbox`). ``detjac`` commands run in this process (click's runner: torch is imported once); other
commands (``head``) through the shell.

    .venv/bin/python tests/doc_examples.py docs/user-guide.md         # run one page's examples, say how each went
    .venv/bin/python tests/doc_examples.py --with-outputs docs/lens.md < docs/lens.md   # the page as the docs build
                                                                                        # publishes it (mkdocs_hooks)
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/user-guide.md", "docs/lens.md", "docs/store-format.md", "docs/real-models.md",
         "docs/graphs.md", "docs/performance.md")
NOT_RUN = re.compile(r"<!--\s*docs:\s*not run:\s*(?P<reason>.*?)\s*-->")
PRINTED = re.compile(r"<!--\s*docs:\s*printed by the python block above\s*-->")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
HUB_IDS = ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-70B", "Qwen/Qwen3-14B")
# What an example names that this machine lacks -> what runs instead (the same code path, on the shipped model).
SUBSTITUTIONS = (
    ("path/to/hf-checkpoint-dir", "default"),
    ("/shared/Qwen3-8B", "default"),
    ("./Llama-3.1-70B", "default"),
    ("--model MODEL", "--model default"),
    ("run MODEL ", "run default "),
    ("--device cuda:0", "--device cpu"),
    ('device="cuda:0"', 'device="cpu"'),
    ("cuda:0=8GiB", "cpu=2GiB"),
    ("file:///shared/q8.zarr", "q8.zarr"),
    ('"layer.20", "mlp.20"', '"layer.2", "mlp.2"'),  # a 40-layer model's middle layer: the default model has 4
    ('"layer.20"', '"layer.2"'),
)


@dataclass
class Example:
    """One fenced block of a page: its kind (``python`` or ``shell``), where it is, what it runs."""

    page: str
    line: int  # of the fence
    kind: str
    code: str  # python: the block; shell: one command per line (continuations joined)
    shown: list[str] = field(default_factory=list)  # shell: each command's shown output; python: what it prints
    not_run: str | None = None  # why the page says it is not run

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def examples(page: str | Path, text: str | None = None) -> list[Example]:
    """The examples of ``page`` (relative to the repository; or of ``text``, its markdown), in page order."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines() if text is None else text.splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        body = lines[i + 1:end]
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")  # blank lines skipped
        reason = NOT_RUN.search(before)
        if PRINTED.search(before) and found and found[-1].kind == "python":
            found[-1].shown = ["\n".join(body) + "\n"]  # what that block prints, checked when it runs
            i = end + 1
            continue
        example = _example(str(page), i + 1, fence["lang"], body)
        if example is not None:
            example.not_run = reason["reason"] if reason else None
            found.append(example)
        i = end + 1
    return found


def _example(page: str, line: int, lang: str, body: list[str]) -> Example | None:
    if lang == "python":
        return Example(page, line, "python", "\n".join(body))
    bare = lang in ("", "bash", "console", "sh")
    commands: list[str] = []
    shown: list[str] = []
    current: str | None = None
    for text in body:
        starts = text.startswith("$ ") or (bare and re.match(r"(detjac|head) ", text))
        if current is not None and current.endswith("\\"):
            current = current[:-1].rstrip() + " " + text.strip()
            commands[-1] = current
            continue
        if starts:
            current = text.removeprefix("$ ")
            commands.append(current)
            shown.append("")
        elif commands:
            current = None
            shown[-1] += text + "\n"
    if not commands:
        return None
    return Example(page, line, "shell", "\n".join(commands), shown)


def substitute(text: str) -> str:
    for old, new in SUBSTITUTIONS:
        text = text.replace(old, new)
    return text


@contextlib.contextmanager
def sandbox(folder: Path) -> Iterator[Path]:
    """A working folder holding what the pages' examples read, with a Hugging Face cache in which the hub ids the
    pages name resolve (offline) to the shipped model; the environment is put back afterwards."""
    from hub_cache import fabricate_hub_cache  # beside this file: tests/ is on the path of pytest and of its runs

    from detjac.engine.checkpoints.default import DEFAULT_MODEL_DIR

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "examples", folder / "examples", dirs_exist_ok=True)
    (folder / "benchmarks").mkdir(exist_ok=True)
    shutil.copytree(ROOT / "benchmarks" / "data", folder / "benchmarks" / "data", dirs_exist_ok=True)
    first = (ROOT / "examples" / "prompts.txt").read_text().splitlines()[:3]  # "your prompts": three suffice
    (folder / "prompts.txt").write_text("\n".join(first) + "\n")
    shutil.copy(ROOT / "examples" / "prompts.jsonl", folder / "corpus.jsonl")
    lens_lines = (ROOT / "benchmarks" / "data" / "lens_fit_prompts.txt").read_text().splitlines()
    (folder / "texts.txt").write_text("\n".join(lens_lines[:4]) + "\n")
    (folder / "heldout.txt").write_text("\n".join(lens_lines[4:6]) + "\n")
    (folder / "concept.txt").write_text("Whale, n. (Zool.) Any aquatic mammal of the order Cetacea\n")
    hub = folder / "hub-cache"
    for repo in HUB_IDS:
        fabricate_hub_cache(hub, repo, DEFAULT_MODEL_DIR)
    saved = dict(os.environ)
    cwd = Path.cwd()
    os.environ.update({"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"})
    os.chdir(folder)
    try:
        yield folder
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)


@dataclass
class Outcome:
    """How one command (or Python block) went: its exit status, output and seconds."""

    command: str
    status: int
    output: str
    seconds: float
    expected_error: bool = False  # the page shows this command failing (its output starts with "Error:")
    missing: list[str] = field(default_factory=list)  # files its comment says it writes that are not there
    unshown: list[str] = field(default_factory=list)  # lines the page shows that the command did not print

    @property
    def ok(self) -> bool:
        return (self.status != 0) == self.expected_error and not self.missing and not self.unshown


NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?")
SECONDS = re.compile(r"\s?s\b")  # a number followed by this is a duration: never compared


def _pattern(shown: str) -> tuple[re.Pattern[str], list[str]]:
    """A shown line as a regular expression over a printed one: its text literal (runs of spaces free, ``...``
    any text), each number a group; and the shown numbers."""
    parts, numbers, at = [], [], 0
    for m in NUMBER.finditer(shown):
        parts.append(_literal(shown[at:m.start()]))
        parts.append(r"([-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?)")
        numbers.append(m[0] if not SECONDS.match(shown, m.end()) else "")  # "" = a duration
        at = m.end()
    parts.append(_literal(shown[at:]))
    return re.compile("".join(parts)), numbers


def _literal(text: str) -> str:
    return ".*?".join("".join(r"\s+" if run.isspace() else re.escape(run) for run in re.split(r"(\s+)", piece) if run)
                      for piece in text.split("..."))


def _close(shown: str, printed: str) -> bool:
    """Numbers agree as far as a page can promise across CPUs: exactly for counts, within 2 % for decimals, within a
    factor of 4 for powers of ten (errors), and not at all below 1e-5 (rounding-level residues)."""
    a, b = float(shown.replace(",", "")), float(printed.replace(",", ""))
    if abs(a) < 1e-5 and abs(b) < 1e-5:
        return True
    if "e" in shown:
        return a * b > 0 and 0.25 <= b / a <= 4.0
    if "." in shown:
        return abs(a - b) <= 0.02 * max(abs(a), abs(b))
    return a == b


def unshown_lines(shown: str, printed: str) -> list[str]:
    """The lines of a page's shown output that the printed output does not give, in order (each shown line matches
    a later printed line; ``...`` lines and text elide, ``#`` lines comment)."""
    lines = [line.rstrip() for line in printed.splitlines()]
    at, missing = 0, []
    for line in shown.splitlines():
        if not line.strip() or line.strip().startswith(("...", "#")):
            continue
        pattern, numbers = _pattern(line.strip())
        for index in range(at, len(lines)):
            m = pattern.fullmatch(lines[index].strip())
            if m and all(not n or _close(n, got) for n, got in zip(numbers, m.groups(), strict=True)):
                at = index + 1
                break
        else:
            missing.append(line)
    return missing


def run_python(example: Example, namespace: dict) -> Outcome:
    """Run a Python block in ``namespace`` (shared by the page's blocks)."""
    import io
    from contextlib import redirect_stdout

    code = substitute(example.code)
    t0, out = time.perf_counter(), io.StringIO()
    try:
        with redirect_stdout(out):
            exec(compile(code, example.where, "exec"), namespace)  # noqa: S102 - the docs' own examples
    except Exception as exc:  # noqa: BLE001 - reported with the block's place
        return Outcome(code, 1, f"{out.getvalue()}{type(exc).__name__}: {exc}", time.perf_counter() - t0)
    return Outcome(code, 0, out.getvalue(), time.perf_counter() - t0)


def run_command(command: str, variables: dict[str, str] | None = None) -> Outcome:
    """Run one shell line: ``detjac ...`` (each part of an ``&&`` chain) in this process, anything else through
    the shell; ``NAME=$(...)`` sets a variable that later lines of the page expand (``variables``)."""
    variables = {} if variables is None else variables
    command = substitute(command).replace(".venv/bin/python", shlex.quote(sys.executable))
    # STORE.zarr:PROMPT_ID (detjac view) and STORE.zarr PROMPT_ID (detjac store export): the store's first prompt
    command = re.sub(r"(\S+\.zarr)([: ])PROMPT_ID", lambda m: f"{m[1]}{m[2]}{_first_prompt(m[1])}", command)
    t0 = time.perf_counter()
    assignment = re.fullmatch(r"([A-Z_]+)=\$\((.*)\)", command)
    if assignment:
        done = subprocess.run(assignment[2], shell=True, capture_output=True, text=True, timeout=600)  # noqa: S602
        variables[assignment[1]] = done.stdout.strip()
        return Outcome(command, done.returncode, done.stderr, time.perf_counter() - t0)
    command = re.sub(r"\$([A-Z_]+)", lambda m: variables.get(m[1], m[0]), command)
    said = said_files(command)
    outputs, status = [], 0
    for part in command.split(" && "):
        part = split_comment(part)[0]
        env, words = env_and_words(part)
        if words and words[0] == "detjac":
            status, output = _detjac(words[1:], env)
        else:
            done = subprocess.run(part, shell=True, capture_output=True, text=True, timeout=600,  # noqa: S602
                                  env={**os.environ, **env})
            status, output = done.returncode, done.stdout + done.stderr
        outputs.append(output)
        if status:
            break
    missing = [name for name in said if not Path(name).exists()] if status == 0 else []
    return Outcome(command, status, "".join(outputs), time.perf_counter() - t0, missing=missing)


FILE_NAME = re.compile(r"[\w./-]+\.(?:csv|png|json|parquet|npz|html|svg|pdf)")


COMMENT = re.compile(r" # |  #")  # a shell line's trailing comment starts here


def split_comment(line: str) -> tuple[str, str | None]:
    """(the command, its trailing comment or None) of one shell line."""
    parts = COMMENT.split(line, maxsplit=1)
    return parts[0].strip(), (parts[1] if len(parts) > 1 else None)


def env_and_words(command: str) -> tuple[dict[str, str], list[str]]:
    """The ``NAME=value`` settings a command line starts with, and its words after them."""
    try:
        words = shlex.split(command)
    except ValueError:  # an unbalanced quote: the page's line as plain words
        words = command.split()
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def said_files(command: str) -> list[str]:
    """The files a command's trailing comment says it writes: a comment that is a list of file names
    (``# columns.csv, columns.png``)."""
    comment = split_comment(command)[1]
    if comment is None:
        return []
    items = [item.strip() for item in comment.split(",")]
    return items if all(FILE_NAME.fullmatch(item) for item in items) else []


def command_options(line: str) -> tuple[list[str], list[str]]:
    """(the detjac command words, the ``--options`` it names) of one command line; ([], []) for another program."""
    words = env_and_words(split_comment(line)[0])[1]
    if not words or words[0] != "detjac":
        return [], []
    command = [w for w in words[1:4] if re.fullmatch(r"[a-z][a-z|-]*", w)]  # `svd|decode`: either
    return command, [w.split("=")[0] for w in words if w.startswith("--")]


def _first_prompt(store: str) -> str:
    from detjac.store import open_store

    ids = open_store(store).prompt_ids()
    return ids[0] if ids else "PROMPT_ID"


def _detjac(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    from click.testing import CliRunner

    from detjac.cli.main import main

    result = CliRunner().invoke(main, args, env=env, catch_exceptions=True)
    output = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        output += "".join(traceback.format_exception(result.exception))
    return result.exit_code, output


def run_page(page: str, folder: Path, log: object = None, text: str | None = None) -> list[tuple[Example, Outcome]]:
    """Run every example of ``page`` (or of its markdown ``text``) that the page does not mark as not run, in one
    sandbox; returns each command's (or block's) outcome."""
    done: list[tuple[Example, Outcome]] = []
    namespace: dict = {"__name__": "__docs__"}
    variables: dict[str, str] = {}
    with sandbox(folder):
        for example in examples(page, text):
            if example.not_run:
                continue
            if example.kind == "python":
                outcomes = [run_python(example, namespace)]
            else:
                outcomes = [run_command(c, variables) for c in example.code.splitlines()]
            for index, outcome in enumerate(outcomes):
                if example.kind == "shell":
                    outcome.expected_error = example.shown[index].lstrip().startswith("Error:")
                if example.shown:  # a command's shown output, or what a Python block is shown to print
                    outcome.unshown = unshown_lines(example.shown[index], outcome.output)
                done.append((example, outcome))
                if log is not None:
                    log(f"{example.where}: exit {outcome.status} in {outcome.seconds:.1f} s: {outcome.command[:90]}")
    return done


SHOWN_LINES = 40  # a command's output shown on a page: at most this many lines (the rest elided)


def progress_line(line: str) -> None:
    """One progress line of a long job (the docs build runs every example of its pages: many minutes), on stderr at
    once, so that a build is never silent while it works."""
    print(f"docs: {line}", file=sys.stderr, flush=True)


def with_outputs(page: str, text: str, folder: Path, log: object = progress_line) -> str:
    """``text`` (a page's markdown) with each command of its examples followed by the output it produced now, in
    place of what the page shows, and a line saying where and how long it ran: what the docs build publishes.
    ``log`` gets a line per example as it ends (None: silent)."""
    import platform

    blocks: dict[int, tuple[Example, list[Outcome]]] = {}
    if log is not None:
        count = len([e for e in examples(page, text) if not e.not_run])
        log(f"{page}: running its {count} examples")  # type: ignore[operator]
    for example, outcome in run_page(page, folder, log=log, text=text):
        if example.kind == "shell":
            blocks.setdefault(example.line, (example, []))[1].append(outcome)
    lines = text.splitlines()
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    for example, outcomes in sorted(blocks.values(), key=lambda block: -block[0].line):  # bottom up: lines shift
        end = next(j for j in range(example.line, len(lines)) if lines[j].startswith("```"))
        body = []
        for command, outcome in zip(example.code.splitlines(), outcomes, strict=True):
            body.append(f"$ {command}")
            shown = outcome.output.rstrip("\n").splitlines()
            if len(shown) > SHOWN_LINES:
                shown = [*shown[:SHOWN_LINES - 1], f"... ({len(shown) - SHOWN_LINES + 1} more lines)"]
            body += [*shown, f"# ({outcome.seconds:.1f} s on {machine}, when this page was built)"]
        lines[example.line:end] = body
    return "\n".join(lines) + "\n"


def main() -> None:
    import tempfile

    if sys.argv[1:2] == ["--with-outputs"]:  # the docs build's hook: the page's markdown in, with outputs out
        page = sys.argv[2]
        with tempfile.TemporaryDirectory() as tmp:
            sys.stdout.write(with_outputs(page, sys.stdin.read(), Path(tmp)))
        return
    pages = sys.argv[1:] or PAGES
    failed = 0
    for page in pages:
        with tempfile.TemporaryDirectory() as tmp:
            for _, outcome in run_page(page, Path(tmp), log=print):
                if not outcome.ok:
                    failed += 1
                    print(outcome.output[-2000:])
                    print("".join(f"shown, not printed: {line}\n" for line in outcome.unshown), end="")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

