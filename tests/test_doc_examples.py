"""The documentation cannot drift from the code: every Python snippet and CLI example of the pages runs against the
shipped default model (``tests/doc_examples.py`` finds and runs them), every command line names only options its
command has, the files a command's comment says it writes are written, and a block the pages do not run says why."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from doc_examples import PAGES, command_options, examples, run_page

from detjac.cli.main import main

ROOT = Path(__file__).resolve().parent.parent

INLINE = re.compile(r"`(detjac [^`]+)`")


def resolve(words: list[str]) -> click.Command:
    """The click command that ``detjac WORDS...`` names (a group's subcommand, as deep as the words go)."""
    command: click.Command = main
    for word in words:
        if isinstance(command, click.Group) and word in command.commands:
            command = command.commands[word]
        else:
            break
    return command


def options_of(command: click.Command) -> set[str]:
    names = {"--help"}
    for param in command.params:
        names.update(o for o in [*param.opts, *param.secondary_opts] if o.startswith("--"))
    return names


def named_commands(page: str) -> list[tuple[str, str]]:
    """(where, command line) of every ``detjac`` command a page names: in its examples and in inline code."""
    found = []
    for example in examples(page):
        if example.kind == "shell":
            found += [(example.where, line) for line in example.code.splitlines()]
    text = (ROOT / page).read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), start=1):
        found += [(f"{page}:{number}", m[1]) for m in INLINE.finditer(line)]
    return found


@pytest.mark.parametrize("page", PAGES)
def test_the_pages_name_only_options_their_commands_have(page: str) -> None:
    wrong = []
    for where, line in named_commands(page):
        for part in line.split(" && "):
            words, options = command_options(part)
            if not words:
                continue
            last = words[-1].split("|")  # `analyze svd|decode --target`: every alternative must have it
            for alternative in last if len(words) > 1 else [words[0]]:
                known = options_of(resolve([*words[:-1], alternative] if len(words) > 1 else words))
                wrong += [f"{where}: {option} in `{part.strip()[:80]}`" for option in options if option not in known]
    assert not wrong, "options the commands do not have:\n" + "\n".join(wrong)


@pytest.mark.parametrize("page", PAGES)
def test_a_block_not_run_says_why(page: str) -> None:
    for example in examples(page):
        if example.not_run is not None:
            assert len(example.not_run) > 10, f"{example.where}: say why it is not run"


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_every_example_of_the_page_runs(page: str, tmp_path: Path) -> None:
    done = run_page(page, tmp_path / "work")
    failed = [f"{example.where}: `{outcome.command[:100]}` exit {outcome.status}"
              + (f", missing {', '.join(outcome.missing)}" if outcome.missing else "")
              + (" (the page shows it failing)" if outcome.expected_error else "")
              + "".join(f"\nshown, not printed: {line}" for line in outcome.unshown)
              + f"\n{outcome.output[-1500:]}"
              for example, outcome in done if not outcome.ok]
    assert not failed, "\n\n".join(failed)
    skipped = [e.where for e in examples(page) if e.not_run]
    print(f"{page}: {len(done)} examples run, {len(skipped)} not run ({', '.join(skipped) or 'none'})")


PRINTS = """
```python
print(1 + 1)
```

<!-- docs: printed by the python block above -->
```
{shown}
```
"""


@pytest.mark.parametrize(("shown", "ok"), [("2", True), ("3", False)])
def test_a_python_block_is_checked_for_what_the_page_says_it_prints(tmp_path: Path, shown: str, ok: bool) -> None:
    [(example, outcome)] = run_page("README.md", tmp_path / "work", text=PRINTS.format(shown=shown))
    assert example.kind == "python" and example.shown == [f"{shown}\n"]
    assert outcome.ok is ok and outcome.unshown == ([] if ok else ["3"])


def test_the_readme_python_block_prints_what_the_readme_shows(tmp_path: Path) -> None:
    """The README's Python tour, run as written: every line it says it prints is printed, token texts and not ids."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### Python"):text.index("### Command line")]
    [python] = [e for e in examples("README.md", section) if e.kind == "python"]
    assert "next token ' or'" in python.shown[0] and "left -> '" in python.shown[0]
    [(_, outcome)] = run_page("README.md", tmp_path / "work", text=section)
    assert outcome.status == 0, outcome.output
    assert outcome.unshown == [], "shown, not printed:\n" + "\n".join(outcome.unshown)


def test_the_docs_build_says_what_it_runs_as_it_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Running a page's examples for the docs build prints a line per example as it ends (on
    stderr), so a build that takes minutes is never silent."""
    from doc_examples import with_outputs

    page = "```\n$ detjac families\n```\n"
    built = with_outputs("docs/user-guide.md", page, tmp_path / "work")
    assert "$ detjac families" in built and "when this page was built" in built
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "docs: docs/user-guide.md: running its 1 examples"
    assert re.fullmatch(r"docs: docs/user-guide\.md:1: exit 0 in \d+\.\d s: detjac families", err[1]), err
