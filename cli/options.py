"""Click options, choices and value parsers shared by the command modules (no heavy imports).

Command modules import only this module and :mod:`detjac.cli.render` from the CLI package.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from detjac.model_settings import DTYPES, LoadSpec, parse_budgets
from detjac.targets import OUTPUT

if TYPE_CHECKING:
    from detjac.engine import ModelRef

TABLE_HELP = "Write the table to this file: Parquet for a .parquet suffix, else CSV."


class ModelName(str):
    """MODEL as typed, with ``kind``: what it names (:func:`detjac.model_names.model_kind`), decided as it was parsed
    and read by :meth:`detjac.engine.ModelRef.resolve` instead of asking the file system again."""

    kind: str

    def __new__(cls, text: str, kind: str) -> ModelName:
        name = super().__new__(cls, text)
        name.kind = kind
        return name

    def __getnewargs__(self) -> tuple[str, str]:  # pickled (a distributed run's options) with its kind
        return str(self), self.kind


class ModelArgument(click.ParamType):
    """MODEL: ``default``, a GGUF file, a checkpoint folder or a hub id, checked for what it names before anything
    heavy is imported (:func:`detjac.model_names.model_kind`: a mistyped path is refused in a fraction of a second).
    The command's model options then resolve it, once, into a :class:`~detjac.engine.ModelRef`
    (:func:`collect_model_options`)."""

    name = "model"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from detjac.model_names import model_kind

        if isinstance(value, str) and not isinstance(value, ModelName):
            return ModelName(value, model_kind(value))  # a CheckpointError: one line, from the CLI's one place
        return value


def model_argument(*, required: bool = False) -> Any:
    """The MODEL argument of every model-loading command (``default`` when omitted, unless ``required``)."""
    if required:
        return click.argument("model", type=ModelArgument())
    return click.argument("model", type=ModelArgument(), default="default", required=False)


def model_ref_option(*, default: str | None, help: str) -> Any:
    """``--model MODEL`` of the lens commands (which take a lens first): checked as MODEL is
    (:class:`ModelArgument`)."""
    return click.option("--model", type=ModelArgument(), default=default, show_default=default is not None, help=help)


def check_budget(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--max-memory``'s syntax, checked as it is parsed (before torch is imported)."""
    parse_budgets(value)
    return value


def check_prompts(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A prompts file that exists, checked as it is parsed (before torch is imported)."""
    if value is not None:
        from detjac.runs import check_prompts_path

        check_prompts_path(value)
    return value


def gguf_file_option(func: Any) -> Any:
    """``--gguf-file NAME``: a GGUF file inside the folder or hub id MODEL."""
    return model_option("gguf_file")(func)


def resolve_model_ref(model: str, gguf_file: str | None = None, revision: str | None = None) -> ModelRef:
    """MODEL (with ``--gguf-file`` and ``--revision``) resolved into the :class:`~detjac.engine.ModelRef` every
    loader takes: the one place the CLI resolves it."""
    from detjac.engine import ModelRef

    return ModelRef.resolve(model, gguf_file, revision)


def prompt_id_option(*, multiple: bool, help: str) -> Any:
    """``--prompt-id ID``: a stored prompt's id, into the command's ``prompt_ids`` (a tuple, with ``multiple``) or
    ``prompt_id`` (None when not given)."""
    dest = "prompt_ids" if multiple else "prompt_id"
    return click.option("--prompt-id", dest, multiple=multiple, default=() if multiple else None, metavar="ID",
                        help=help)


# -- the one option set of the one-prompt commands (jacobian, svd, steer, demo, lens apply) ------------------------


def prompt_options(*, required: bool = True, multiple: bool = False) -> Any:
    """``--prompt/-p TEXT`` and ``--prompt-file FILE`` (its whole text, stripped), collapsed into the command's
    ``prompt`` argument: the text (None when not ``required`` and neither is given), or with ``multiple`` the
    tuple of every ``--prompt`` and ``--prompt-file`` given, in that order."""

    def decorate(func: Any) -> Any:
        @functools.wraps(func)
        def command(*args: Any, **kwargs: Any) -> Any:
            texts, files = kwargs.pop("prompt_texts"), kwargs.pop("prompt_files")
            given = [*texts, *(_read_prompt_file(f) for f in files)]
            if multiple:
                return func(*args, prompt=tuple(given), **kwargs)
            if len(given) > 1 or (required and not given):
                raise click.UsageError(f"Expected exactly one of --prompt and --prompt-file. Got {len(given)}.")
            return func(*args, prompt=given[0] if given else None, **kwargs)

        what = "A prompt (repeatable)" if multiple else "Prompt text"
        command = click.option("--prompt-file", "prompt_files", type=click.Path(dir_okay=False), multiple=True,
                               help="Read the prompt from this UTF-8 text file (its whole text, stripped)"
                                    + (" (repeatable)." if multiple else "."))(command)
        return click.option("--prompt", "-p", "prompt_texts", multiple=True,
                            help=f"{what} (tokenized with the model's tokenizer).")(command)

    return decorate


def _read_prompt_file(path: str) -> str:
    from detjac.errors import PromptError

    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptError(f"Expected a readable UTF-8 text file for --prompt-file. Got {path}: {exc}") from exc


def refuse_options(spec: LoadSpec, command: str, why: str, **defaults: Any) -> None:
    """A UsageError when an option of ``spec`` differs from ``defaults`` (name -> the only value ``command`` takes)."""
    changed = [name for name, value in defaults.items() if getattr(spec, name) != value]
    if changed:
        names = ", ".join("--" + n.replace("_", "-") for n in changed)
        raise click.UsageError(f"Expected no {names} with {command}: {why}.")


_MODEL_OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {  # name -> (declarations, click settings)
    "dtype": (("--dtype",), {"type": click.Choice(DTYPES), "default": "float64", "show_default": True,
                             "help": "Compute dtype; float64 is the exactness mode."}),
    "device": (("--device",), {"default": "cpu", "show_default": True, "help": "Torch device, e.g. cuda:0."}),
    "streamed": (("--streamed",), {"is_flag": True,
                                   "help": "The layer-streamed engine: one decoder layer's weights in memory at a "
                                           "time (the same Jacobian, for models larger than memory)."}),
    "max_memory": (("--max-memory",), {"default": None, "callback": check_budget,
                                       "help": "Memory budget per device, e.g. cpu=4GiB or cuda:0=8GiB,cpu=32GiB "
                                               "(implies --streamed)."}),
    "revision": (("--revision",), {"default": None,
                                   "help": "Revision (branch, tag or commit) of a hub id MODEL [default: main]."}),
    "trust_remote_code": (("--trust-remote-code",), {"is_flag": True,
                                                     "help": "Allow the checkpoint's own Python code (off by "
                                                             "default)."}),
    "gguf_file": (("--gguf-file",), {"default": None, "metavar": "NAME",
                                     "help": "Load the GGUF file NAME inside the folder or hub id MODEL (e.g. a hub "
                                             "repository of quantized files); MODEL may also be a .gguf file "
                                             "itself."}),
}


def model_option(name: str, **changes: Any) -> Any:
    """One option of :func:`model_options` by its name (``dtype``, ``device``, ``streamed``, ``max_memory``,
    ``revision``, ``trust_remote_code``, ``gguf_file``), with ``changes`` to its click settings (a command's own help
    or default): for a command that places the options among its own and collapses them with
    :func:`collect_model_options`."""
    declarations, settings = _MODEL_OPTIONS[name]
    return click.option(*declarations, **{**settings, **changes})


# torch runs bfloat16 matmuls on most CPUs without native support: a run in it is slow and nothing said why.
BF16_ON_CPU = "Note: --dtype bfloat16 is a GPU dtype; on a CPU it is slow (SmolLM2-135M took 186 s a prompt)."


def collect_model_options(func: Any) -> Any:
    """The options of :func:`model_option` collapsed into the command's ``model_options`` argument (a
    :class:`~detjac.model_settings.LoadSpec`), its MODEL resolved with ``--gguf-file`` and ``--revision`` into a
    :class:`~detjac.engine.ModelRef`, once, here (the command receives it as ``model`` and in the spec); apply it
    above them. A command whose MODEL may be left out (None) receives ``gguf_file`` and ``revision`` to resolve the
    model it finds. A CPU budget on the CPU sets this process's allocator (:func:`detjac.engine.honour_cpu_budget`)."""
    @functools.wraps(func)
    def command(*args: Any, **kwargs: Any) -> Any:
        given = {k: kwargs.pop(k) for k in _MODEL_OPTIONS if k in kwargs}
        gguf_file, revision = given.pop("gguf_file", None), given.pop("revision", None)
        spec = LoadSpec(**given)
        if spec.dtype == "bfloat16" and str(spec.device).startswith("cpu"):  # said before any work starts
            click.echo(BF16_ON_CPU, err=True)
        if isinstance(kwargs.get("model"), str):
            kwargs["model"] = resolve_model_ref(kwargs["model"], gguf_file, revision)
            spec = replace(spec, model=kwargs["model"])
        elif "model" in kwargs:
            kwargs.update(gguf_file=gguf_file, revision=revision)
        if spec.max_memory:  # a budget: the engine's rule decides whether this process's allocator follows it
            from detjac.engine import honour_cpu_budget

            honour_cpu_budget(spec.device, spec.max_memory)
        return func(*args, model_options=spec, **kwargs)

    return command


def model_options(*, dtype: str = "float64") -> Any:
    """``--dtype``, ``--device``, ``--streamed``, ``--max-memory``, ``--revision``, ``--trust-remote-code`` and
    ``--gguf-file``, collapsed into the command's ``model_options`` argument (a
    :class:`~detjac.model_settings.LoadSpec`)."""

    def decorate(func: Any) -> Any:
        command = collect_model_options(func)
        for name in reversed(_MODEL_OPTIONS):
            command = model_option(name, **({"default": dtype} if name == "dtype" else {}))(command)
        return command

    return decorate


ROW_BLOCK_HELP = ("Jacobian rows per block (the result does not change; memory grows with it). Default: chosen by the "
                  "engine's cost model: all d_model rows in one block where the MLPs fold and they fit the memory "
                  "this machine has free (or --max-memory), else as many as fit, each block one more pass over the "
                  "weights; give a number to override.")


def out_option(help: str, check: Any = None) -> Any:
    """``--out/-o PATH`` (what it writes: ``help``) and ``--force`` (replace it); ``check(out, force)`` refuses an
    ``--out`` it cannot write as the command line is parsed (``--force`` is read first), before torch is imported."""

    def checked(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is not None and check is not None:
            check(value, bool(ctx.params.get("force")))
        return value

    def decorate(func: Any) -> Any:
        func = click.option("--force", is_flag=True, is_eager=True,
                            help="With --out: replace the file if it exists.")(func)
        return click.option("--out", "-o", "out", default=None, help=help, callback=checked)(func)

    return decorate


def output_check(suffix: str | None = None, kind: str = "file") -> Any:
    """The ``check(out, force)`` of :func:`out_option` for an output of this ``kind`` (``file`` ending in ``suffix``,
    ``folder`` or ``store``): :func:`detjac.outputs.check_output`, as the command line is parsed."""

    def check(out: str, force: bool) -> None:
        check_out(out, force=force, kind=kind, suffix=suffix)

    return check


def check_out(out: str, *, force: bool = False, kind: str = "file", suffix: str | None = None,
              reads: list[tuple[str, Any]] | None = None) -> Any:
    """:func:`detjac.outputs.check_output` of a command's output; a store's (``kind="store"``) may be a ``file://``
    URL, checked as the folder it names."""
    from detjac.outputs import check_output

    if kind == "store" and "://" in out:
        from detjac.store import store_path

        out = str(store_path(out))
    return check_output(out, force=force, kind=kind, suffix=suffix, reads=reads or [])


def check_results(stores: list[str], folders: tuple[str | None, ...] = (), files: tuple[str | None, ...] = (),
                  what: str = "the store") -> None:
    """The folders and files an analysis writes its tables and plots into (``None``: not asked for), checked by
    :func:`check_out` before the ``stores`` it reads open: never inside them or any other store or index, never in
    a missing folder or at a link. What is there is replaced, as these outputs always were (no ``--force``)."""
    reads = [(what, store) for store in stores if "://" not in store]
    for out, kind in [*((f, "folder") for f in folders), *((f, "file") for f in files)]:
        if out is not None:
            check_out(out, force=True, kind=kind, reads=reads)


def model_reads(model: Any) -> list[tuple[str, str]]:
    """What a command reads of MODEL (a resolved :class:`~detjac.engine.ModelRef`), for
    :func:`detjac.outputs.check_output`'s ``reads``: its folder or file when it is one on this machine."""
    location = getattr(model, "location", None)
    local = location and getattr(model, "kind", "") != "default" and Path(location).exists()
    return [("the model", location)] if local else []


def cluster_options(*, memory_limit: str, work: str = "the work") -> Any:
    """``--workers``, ``--scheduler`` and ``--memory-limit`` (its default ``memory_limit``: the command's), collapsed
    into the command's ``cluster`` argument (a :class:`~detjac.runs.scheduler.ClusterOptions`); ``work`` names what
    goes to the workers in the help."""

    def decorate(func: Any) -> Any:
        @functools.wraps(func)
        def command(*args: Any, **kwargs: Any) -> Any:
            from detjac.runs import ClusterOptions

            cluster = ClusterOptions(kwargs.pop("workers"), kwargs.pop("scheduler"), kwargs.pop("memory_limit"))
            return func(*args, cluster=cluster, **kwargs)

        command = click.option("--memory-limit", default=memory_limit, show_default=True,
                               help="Memory limit per LocalCluster worker (--workers); auto shares this machine's "
                                    "memory.")(command)
        command = click.option("--scheduler", default=None,
                               help=f"Spread {work} over the workers of this dask.distributed scheduler, e.g. "
                                    "tcp://10.0.0.5:8786.")(command)
        return click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
                            help=f"Spread {work} over a LocalCluster of this many worker processes on this machine "
                                 "(0: this process).")(command)

    return decorate


def corpus_options(*, what: str, long_prompts: str = "") -> Any:
    """``--prompts-format`` and ``--max-tokens`` for the commands that read a corpus (``run``, ``neurons``), declared
    once; ``what`` names the corpus argument in the help, ``long_prompts`` adds what the command does with a prompt
    over the limit."""

    def decorate(func: Any) -> Any:
        command = click.option("--max-tokens", type=click.IntRange(min=1), default=None,
                               help="Refuse prompts longer than this many tokens (default: the model's context)"
                                    f"{long_prompts}.")(func)
        return click.option("--prompts-format", type=click.Choice(["txt", "jsonl"]), default=None,
                            help=f"How to read {what} when its name does not say (.txt: one prompt per line; .jsonl, "
                                 ".ndjson: one JSON object per line).")(command)

    return decorate


def force_new_option(*, replaces: str) -> Any:
    """``--force-new``, declared once: ``replaces`` says what it replaces and how, in the command's words."""
    return click.option("--force-new", is_flag=True, help=f"Replace {replaces}.")


def parse_token(value: str) -> int | None:
    """``--token``: ``combined`` -> None, else a token index (negative from the end)."""
    if value == "combined":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise click.BadParameter(f"Expected 'combined' or a token index. Got {value!r}.") from exc


def parse_target(value: str | None) -> str | None:
    """``--target``: ``output`` (the model's) -> None, else the layerwise target as given."""
    return None if value in (None, OUTPUT) else value


def parse_strengths(value: str) -> list[float]:
    """``--strengths``: comma-separated numbers, at least one."""
    try:
        values = [float(v) for v in value.split(",") if v.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"Expected comma-separated numbers such as 0,0.5,1,2. Got {value!r}.") from exc
    if not values:
        raise click.BadParameter(f"Expected at least one strength. Got {value!r}.")
    return values


def parse_concept_source(value: str) -> tuple[str, str]:
    """``--concept-from``: ``STORE:PROMPT_ID`` -> (store path, prompt id); the store path may hold colons."""
    path, sep, pid = value.rpartition(":")
    if not sep or not path or not pid:
        raise click.BadParameter(f"Expected STORE:PROMPT_ID (e.g. run.zarr:3f2a9c0d1e2b4a5f). Got {value!r}.")
    return path, pid
