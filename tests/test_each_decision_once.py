"""Each decision has one home, which these tests hold to its contract
(no model is loaded, except the shipped default one's config)."""

from __future__ import annotations

import ast
import math
import re
from dataclasses import fields
from pathlib import Path

import pytest

from detjac.errors import InvalidArgumentError, LinearizationError
from detjac.exactness import check_exact, pieces_bound
from detjac.model_settings import LoadSpec, wants_streamed

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("core", "engine", "graphs", "store", "analysis", "runs", "view", "cli")


def calls_of(names: set[str]) -> dict[str, set[str]]:
    """File (relative to the repository) -> the functions among ``names`` it calls (by name or as an attribute)."""
    found: dict[str, set[str]] = {}
    for folder in LIBRARY:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                    if name in names:
                        found.setdefault(str(path.relative_to(ROOT)), set()).add(name)
    return found


def test_the_streamed_engine_is_implied_in_one_place():
    assert not wants_streamed(False, None, None)
    assert wants_streamed(True) and wants_streamed(False, "cpu=1GiB") and wants_streamed(False, None, "nf4")
    assert not wants_streamed(False, "", None)  # an empty budget asks for nothing, as load_engine has always read it
    assert LoadSpec(max_memory="cpu=1GiB").streamed_engine and not LoadSpec().streamed_engine
    # every loader and the run read LoadSpec.streamed_engine; nothing else decides
    assert calls_of({"wants_streamed"}) == {"core/model_settings.py": {"wants_streamed"}}


def test_a_run_with_layerwise_targets_implies_the_streamed_engine_through_its_load_spec():
    from detjac.runs.run import RunOptions, check_options

    assert check_options(RunOptions(lens=True)).load.streamed_engine
    assert check_options(RunOptions(layers="0")).load.streamed_engine
    assert not check_options(RunOptions()).load.streamed_engine
    assert check_options(RunOptions(layers="all", components="layer")).load.streamed


def test_what_a_model_names_is_asked_in_one_place():
    """Whether MODEL is ``default``, a GGUF file, a folder or a hub id is decided by model_names.model_kind, called by
    ModelRef.resolve (and by the CLI's MODEL argument, to refuse a mistyped path before torch is imported); the
    loaders read ModelRef.kind."""
    asked = calls_of({"model_kind", "is_gguf", "is_hub_id", "looks_like_gguf", "resolve_model", "portable_location"})
    assert asked == {
        "core/model_names.py": {"is_gguf", "is_hub_id", "looks_like_gguf"},  # model_kind itself
        "engine/checkpoints/reference.py": {"model_kind"},  # ModelRef.resolve, and a ModelRef built by hand
        "cli/options.py": {"model_kind"},  # the MODEL argument's early check
        "runs/lens_artifact.py": {"is_hub_id"},  # a lens named ORG/NAME:FILE (a lens, not a MODEL)
    }, asked


def test_a_model_ref_is_not_resolved_again_below_its_boundary(monkeypatch):
    import detjac.engine.checkpoints.reference as reference
    from detjac.engine import DEFAULT_MODEL_DIR, ModelRef
    from detjac.engine.checkpoints.loading import check_checkpoint_dir

    ref = ModelRef.resolve("default")
    assert ref.kind == "default" and ModelRef.of(ref) is ref

    def asked_again(*args: object, **kwargs: object) -> str:
        raise AssertionError("MODEL resolved again")

    monkeypatch.setattr(reference, "model_kind", asked_again)
    assert check_checkpoint_dir(ref) == DEFAULT_MODEL_DIR
    with pytest.raises(AssertionError, match="resolved again"):
        ModelRef.of("default")  # a string is resolved (the Python API's entry), which is what the check catches


def test_the_cli_turns_model_into_a_model_ref_once(tmp_path):
    import click
    from click.testing import CliRunner

    from detjac.cli.options import model_argument, model_options
    from detjac.engine import ModelRef

    got = []

    @click.command()
    @model_argument()
    @model_options()
    def command(model: ModelRef, model_options: object) -> None:
        got.append(model)

    (tmp_path / "ckpt").mkdir()
    assert CliRunner().invoke(command, [str(tmp_path / "ckpt")]).exit_code == 0
    assert CliRunner().invoke(command, []).exit_code == 0
    assert got == [ModelRef(str(tmp_path / "ckpt"), str((tmp_path / "ckpt").resolve()), None, "folder"),
                   ModelRef("default", "default", None, "default")]
    assert [r.kind for r in got] == ["folder", "default"]


def test_what_model_names_is_asked_once_per_command(tmp_path, monkeypatch):
    """The MODEL argument's early check decides the kind; ModelRef.resolve reads it instead of asking again."""
    import click
    from click.testing import CliRunner

    import detjac.engine.checkpoints.reference as reference
    import detjac.model_names as names
    from detjac.cli.options import model_argument, model_options

    asked = []

    def counted(*args: object, **kwargs: object) -> str:
        asked.append(args)
        return names_kind(*args, **kwargs)

    names_kind = names.model_kind
    monkeypatch.setattr(names, "model_kind", counted)
    monkeypatch.setattr(reference, "model_kind", counted)

    @click.command()
    @model_argument()
    @model_options()
    def command(model: object, model_options: object) -> None:
        pass

    (tmp_path / "ckpt").mkdir()
    for argv in ([str(tmp_path / "ckpt")], []):
        asked.clear()
        assert CliRunner().invoke(command, argv).exit_code == 0
        assert len(asked) == 1, asked


def test_the_load_and_cluster_options_are_declared_once_and_composed():
    """A run's and a neuron index's options hold one load spec and one cluster-options value and repeat none of
    their fields; the CLI declares each of those options in one place."""
    from detjac.runs import ClusterOptions, NeuronOptions, RunOptions

    shared = {f.name for f in fields(LoadSpec)} | {f.name for f in fields(ClusterOptions)}
    for kind in (RunOptions, NeuronOptions):
        names = {f.name: f.type for f in fields(kind)}
        assert names["load"] == "LoadSpec" and names["cluster"] == "ClusterOptions", kind
        assert not shared & set(names), (kind, shared & set(names))
    declared = {}
    for path in (ROOT / "cli").glob("*.py"):
        for flag in ("--memory-limit", "--workers", "--scheduler", "--max-memory", "--gguf-file", "--revision"):
            found = re.findall(rf'option\(\s*"{flag}"|\(\("{flag}",\)', path.read_text())  # a click declaration
            declared.setdefault(flag, []).extend([path.name] * len(found))
    assert declared == {flag: ["options.py"] for flag in declared}, declared


def test_every_command_and_run_loads_through_load_engine():
    """cli/ and runs/ build a LoadSpec and call load_engine: no engine constructor or raw model loader of their own."""
    raw = calls_of({"load_model", "StreamedEngine", "InMemoryEngine", "as_engine"})
    assert {path: names for path, names in raw.items() if path.startswith(("cli/", "runs/"))} == {}
    from detjac.engine import load_engine

    with pytest.raises(InvalidArgumentError, match="Expected a load spec naming a resolved model"):
        load_engine(LoadSpec())  # nothing resolved: refused before anything loads


def test_the_cpu_budget_allocator_setting_is_one_rule_the_applications_call(monkeypatch):
    """A CPU budget on the CPU sets the process's allocator by one rule (the engine's honour_cpu_budget), called by
    the applications that own a process (the CLI, a run's workers), never from a library call of load_engine."""
    from detjac.engine import memory

    calls: list[int] = []
    monkeypatch.setattr(memory, "return_freed_memory", lambda: calls.append(1))
    assert not memory.honour_cpu_budget("cpu", "cuda:0=8GiB")
    assert not memory.honour_cpu_budget("cuda:0", "cpu=8GiB")
    assert calls == []
    assert memory.honour_cpu_budget("cpu", "cuda:0=8GiB,cpu=8GiB") and calls == [1]
    # the CLI, a run's worker processes and the rule itself; no loader
    assert calls_of({"honour_cpu_budget", "return_freed_memory"}) == {
        "cli/options.py": {"honour_cpu_budget"}, "runs/cluster.py": {"honour_cpu_budget"},
        "engine/memory.py": {"return_freed_memory"}}


def test_a_model_reference_is_resolved_once_and_kept_portable(tmp_path):
    from detjac.engine import DEFAULT_MODEL_DIR, ModelRef

    (tmp_path / "ckpt").mkdir()
    ref = ModelRef.resolve(str(tmp_path / "ckpt" / ".." / "ckpt"))
    assert ref.location == str((tmp_path / "ckpt").resolve()) and ref.name == str(tmp_path / "ckpt" / ".." / "ckpt")
    default = ModelRef.resolve("default")
    assert default.location == "default" and Path(default.source) == DEFAULT_MODEL_DIR  # each process finds its own


@pytest.mark.parametrize("error", [1e-3, math.nan])
def test_the_float64_exactness_check_has_one_wording(error):
    with pytest.raises(LinearizationError) as info:
        check_exact(error, "float64", where="Prompt on line 3: ", what="layer.1")
    assert str(info.value) == (f"Prompt on line 3: float64 reconstruction error of layer.1 {error:.3e} is above "
                               "1e-09; a nonlinearity escaped detaching.")
    with pytest.raises(LinearizationError, match="escaped the Llama detach rules"):
        check_exact(error, "torch.float64", family="Llama")
    check_exact(error, "float32")  # lower precisions only round
    check_exact(error, "float64", detached=False)  # an ordinary Jacobian is not exact
    check_exact(1e-15, "float64")
    bounds = pieces_bound("torch.float64"), pieces_bound("float32"), pieces_bound("torch.bfloat16")
    assert bounds == (1e-9, 1e-3, 5e-2)


def test_keep_is_parsed_once_into_the_run_description(monkeypatch):
    from detjac.runs.description import RunDescription

    def described(keep: str) -> RunDescription:
        return RunDescription("m", "m", None, "llama", "0" * 64, "Llama", "float64", keep, True, -1, (), None, None, 8)

    assert described("rank:4").rank == 4 and described("full").rank is None and not described("none").keeps_jacobian
    assert "rank" not in described("rank:4").as_dict()  # the stored description is as it was
    with pytest.raises(InvalidArgumentError, match="Expected --keep full, --keep rank:K"):
        described("rank:0")
    from dataclasses import replace

    import detjac.store as store

    parsed = described("rank:4")
    # a description holding a Keep (check_options's) never parses it again, nor does a replaced copy
    monkeypatch.setattr(store.Keep, "parse", classmethod(lambda cls, text: pytest.fail("--keep parsed again")))
    assert replace(parsed, n_layers=3).keep is parsed.keep


def test_keep_has_one_type_parsed_once():
    from detjac.store import Keep

    for text in ("full", "none", "rank:4"):
        assert str(Keep.parse(text)) == text and Keep.parse(Keep.parse(text)) == Keep.parse(text)
    assert Keep.parse("rank:4") == Keep(rank=4) and Keep.of_run({}).full and not Keep.of_run({"keep": "none"}).jacobian
    assert Keep.of_prompt({"keep": "rank:3", "rank": 2}).rank == 3 and Keep.of_prompt({"rank": 2}).low_rank
    assert Keep.of_prompt({}).full and not Keep.of_prompt({"keep": "none"}).jacobian
    with pytest.raises(InvalidArgumentError, match="Got 'rank:x'"):
        Keep.parse("rank:x")


def test_a_job_opens_each_prompt_once():
    from detjac.analysis.jobs import OpenedPrompts

    class Store:
        opened: list[str] = []

        def get(self, pid: str) -> object:
            self.opened.append(pid)
            return object()

    store = Store()
    opened = OpenedPrompts(store)  # type: ignore[arg-type]
    assert opened("a") is opened("a") and opened("b") is not opened("a")
    assert store.opened == ["a", "b"]


def test_a_dtype_is_read_one_way_by_every_model_source(tmp_path, monkeypatch):
    """``load_engine(gguf, dtype="float32")`` reaches the GGUF loader as a torch dtype, never as a string."""
    import torch

    import detjac.engine.checkpoints.gguf as gguf
    from detjac.engine import load_engine

    seen = []

    class Loaded(Exception):
        pass

    def dequantize(source: Path, *, dtype: object, device: object = "cpu") -> None:
        seen.append(dtype)
        raise Loaded

    monkeypatch.setattr(gguf, "load_gguf_model", dequantize)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    for spelling in ("float32", "torch.float32", torch.float32):
        with pytest.raises(Loaded):
            load_engine(str(tmp_path / "m.gguf"), dtype=spelling)
    assert seen == [torch.float32] * 3
    for streamed in (False, True):
        assert load_engine("default", dtype="float32", streamed=streamed).dtype == torch.float32
    with pytest.raises(InvalidArgumentError, match="Expected a dtype among float64, float32, bfloat16"):
        load_engine("default", dtype="fp32")


def test_a_prompts_reconstruction_errors_are_computed_in_the_prompt_pass_only():
    """The prompt pass accumulates every target's reconstruction from its blocks and computes the
    error; a run's batch and the Jacobian verb read them from its products instead of computing their own."""
    root = Path(__file__).resolve().parents[1]
    for path in ("runs/batch.py", "engine/verbs.py"):
        text = (root / path).read_text(encoding="utf-8")
        assert "relative_error" not in text and "einsum" not in text and "reconstruct(" not in text, path
    assert "relative_error(" in (root / "engine" / "prompt_products.py").read_text(encoding="utf-8")


def test_analyze_svd_opens_each_prompt_once(tmp_path, monkeypatch):
    """The SVD opens a prompt, and the analysis writer takes its source digest from the prompt's checked
    attributes, not by opening it again."""
    from click.testing import CliRunner

    from detjac.cli.main import main
    from detjac.store.backend.zarr_store import ZarrStore
    from detjac.store.testing import make_store

    make_store(tmp_path / "s.zarr", prompts=3)
    opened: list[str] = []
    get = ZarrStore.get

    def counted(self: ZarrStore, pid: str):  # noqa: ANN202
        opened.append(pid)
        return get(self, pid)

    monkeypatch.setattr(ZarrStore, "get", counted)
    result = CliRunner().invoke(main, ["analyze", "svd", str(tmp_path / "s.zarr")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert len(opened) == 3 and len(set(opened)) == 3
