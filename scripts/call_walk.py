"""The walk of one prompt through detjac: which detjac functions ``detjac run`` (one prompt, the shipped model) and
``detjac analyze svd`` (the store it wrote) and ``detjac graph`` (one prompt) call, and across which modules.

A ``sys.setprofile`` tracer (threads included: dask computes in its own) records every call whose callee lives in a
``detjac`` module, as a call site: (calling detjac function, called detjac function). A call site counts once however
often it runs (a loop over row blocks is one site). Comprehensions, generator expressions and lambdas count as the
function that holds them. Printed per command: the distinct call sites, functions and modules, in all and on the
orchestration path (every module outside ``detjac.engine``: cli/ -> runs/ -> store/ -> analysis/ and back; the
engine's numerics are the engine's own business), those of them that cross from one module into another, how often
the decisions of issue 51 run (MODEL resolved, ``--keep`` parsed, the exactness check, a prompt opened, a model
matrix read: :data:`WATCHED`), and with ``--list`` the path's call sites. A module's body running on import is not a
call, nor what it calls, nor is a class's body (run once, when its module is imported), nor is generated code (a
dataclass's ``__init__``). "Between layers": the call sites whose caller and callee are in different layers of
README's "Architecture" (core, engine, store, analysis, runs, view, cli). "Read from cli/runs": the call sites whose
caller is in cli/ or runs/ (what a reader of a command's orchestration follows; the callee may be anywhere).

Usage::

    python -m scripts.call_walk                   # this checkout (the detjac the interpreter imports)
    python -m scripts.call_walk --root /tmp/old   # another checkout's source tree, imported in place of it
    python -m scripts.call_walk --list            # also the orchestration path's call sites, in first-call order
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
import threading
import tomllib
from pathlib import Path
from typing import Any

ANONYMOUS = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>")
IMPORT = "<module>"  # a module's body running on import: not a call of the path
OPTIMIZED = inspect.CO_OPTIMIZED  # set on a function's code; a class body (run once, on import) lacks it
# the decisions item by item: how often each runs (calls, not sites) in one command
WATCHED = ("model_kind", "ModelRef.resolve", "resolve_model", "select_gguf", "is_hub_id", "check_checkpoint_dir",
           "portable_location", "model_ref", "Keep.parse", "wants_streamed", "check_exact", "_check_exact",
           "ZarrStore.get", "ZarrStore.model_array")


def use_checkout(root: Path) -> None:
    """Import ``detjac`` from the source tree ``root`` (its pyproject's package-dir mapping) instead of the
    installed one."""
    import importlib.util

    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]

    class Finder:
        @staticmethod
        def find_spec(name: str, path: Any = None, target: Any = None) -> Any:
            if name not in mapping:
                return None
            folder = root / mapping[name]
            return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])

    sys.meta_path.insert(0, Finder())


class Walk:
    """The call sites seen between :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        self.sites: dict[tuple[str, str], None] = {}  # (caller, callee) in first-call order
        self.functions: dict[str, None] = {}
        self.calls: dict[str, int] = {}  # function -> how often it ran

    @staticmethod
    def _name(frame: Any) -> str | None:
        """``module:function`` of a detjac frame (a comprehension's or lambda's: its holder's); None elsewhere."""
        while frame is not None:
            if frame.f_code.co_filename.startswith("<"):  # generated code (a dataclass's __init__): not detjac's
                return None
            module = frame.f_globals.get("__name__", "")
            if not (module == "detjac" or module.startswith("detjac.")):
                return None
            if frame.f_code.co_name == IMPORT:
                return None
            if frame.f_code.co_name not in ANONYMOUS:
                return f"{module}:{frame.f_code.co_qualname}"
            frame = frame.f_back
        return None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_name in (*ANONYMOUS, IMPORT) or not frame.f_code.co_flags & OPTIMIZED:
            return  # not a call of the path: a comprehension, or a module's or class's body running on import
        callee = self._name(frame)
        if callee is None:
            return
        caller = frame.f_back
        while caller is not None and self._name(caller) is None:  # through library frames (click, dask) to detjac
            if caller.f_code.co_name == IMPORT:  # called by a module's body as it is imported: not the path's call
                return
            caller = caller.f_back
        self.functions.setdefault(callee)
        self.calls[callee] = self.calls.get(callee, 0) + 1
        self.sites.setdefault((self._name(caller) if caller is not None else "<entry>", callee))

    def start(self) -> None:
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def module_of(name: str) -> str:
    return name.partition(":")[0]


def layer_of(name: str) -> str:
    """The layer (README "Architecture") a function lives in: ``detjac.runs.batch:f`` -> ``runs``; the package's
    top-level modules (``detjac.singular``, ...) are the core's."""
    parts = module_of(name).split(".")
    return parts[1] if len(parts) > 2 else "core"


ORCHESTRATION = ("cli", "runs")  # the layers that say what a command does; the others are libraries they call


def on_path(name: str) -> bool:
    """Whether a function is on the orchestration path (outside the engine's numerics)."""
    return not module_of(name).startswith("detjac.engine")


def report(title: str, walk: Walk, listing: bool) -> None:
    path_sites = [(a, b) for a, b in walk.sites if on_path(b)]
    path_functions = [f for f in walk.functions if on_path(f)]
    print(f"{title}")
    print(f"  all detjac:          {len(walk.sites):4d} call sites, {len(walk.functions):4d} functions, "
          f"{len({module_of(f) for f in walk.functions}):3d} modules")
    print(f"  orchestration path:  {len(path_sites):4d} call sites, {len(path_functions):4d} functions, "
          f"{len({module_of(f) for f in path_functions}):3d} modules (outside detjac.engine)")
    crossing = [(a, b) for a, b in path_sites if module_of(a) != module_of(b)]
    print(f"  of which crossing:   {len(crossing):4d} call sites from one module into another")
    layered = [(a, b) for a, b in walk.sites if a != "<entry>" and layer_of(a) != layer_of(b)]
    entered = {b for _, b in layered}
    print(f"  between layers:      {len(layered):4d} call sites into {len(entered):3d} functions of "
          f"{len({module_of(f) for f in entered}):3d} modules (a caller in one layer, the callee in another)")
    read = [(a, b) for a, b in walk.sites if layer_of(a) in ORCHESTRATION]
    print(f"  read from cli/runs:  {len(read):4d} call sites, {len({b for _, b in read}):4d} functions, "
          f"{len({module_of(f) for site in read for f in site}):3d} modules (the calls a reader of cli/ and runs/ "
          f"follows: a caller there, the callee anywhere)")
    watched = {f: n for f, n in walk.calls.items() if f.partition(":")[2] in WATCHED}
    print("  decisions (calls):   " + (", ".join(f"{f.partition(':')[2]} {n}" for f, n in sorted(watched.items()))
                                       or "none"))
    if listing:
        for caller, callee in path_sites:
            print(f"    {caller} -> {callee}")


def invoke(main: Any, args: list[str], walk: Walk) -> None:
    from click.testing import CliRunner

    walk.start()
    try:
        result = CliRunner().invoke(main, args, catch_exceptions=False)
    finally:
        walk.stop()
    if result.exit_code:
        raise SystemExit(f"detjac {' '.join(args)} exited {result.exit_code}:\n{result.output}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None, help="a detjac source tree to import instead")
    parser.add_argument("--list", action="store_true", help="print the orchestration path's call sites")
    args = parser.parse_args(argv)
    if args.root is not None:
        use_checkout(args.root.resolve())
    import detjac.cli.main as cli

    print(f"detjac from {Path(cli.__file__).resolve().parents[1]}")
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.txt"
        prompts.write_text("Kitten, n. A young cat\n")
        store = str(Path(tmp) / "run.zarr")
        walk = Walk()
        invoke(cli.main, ["run", "default", str(prompts), "--out", store], walk)
        report("detjac run default prompts.txt --out run.zarr  (one prompt)", walk, args.list)
        walk = Walk()
        invoke(cli.main, ["analyze", "svd", store], walk)
        report("detjac analyze svd run.zarr", walk, args.list)
        walk = Walk()
        graph = str(Path(tmp) / "graph.json")
        invoke(cli.main, ["graph", "default", "-p", "Kitten, n. A young cat", "--out", graph], walk)
        report("detjac graph default -p 'Kitten, n. A young cat' --out graph.json", walk, args.list)


if __name__ == "__main__":
    main()
