"""Issue 51, items 6-8: each decision has one home, which these tests hold to its contract (no model is loaded)."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import pytest

from detjac.errors import InvalidArgumentError, LinearizationError
from detjac.exactness import check_exact, pieces_bound
from detjac.model_settings import ModelSettings, wants_streamed


def test_the_streamed_engine_is_implied_in_one_place():
    assert not wants_streamed(False, None, None)
    assert wants_streamed(True) and wants_streamed(False, "cpu=1GiB") and wants_streamed(False, None, "nf4")
    assert not wants_streamed(False, "", None)  # an empty budget asks for nothing, as load_engine has always read it
    assert ModelSettings(max_memory="cpu=1GiB").streamed_engine and not ModelSettings().streamed_engine


def test_the_model_settings_are_defined_once_and_extended():
    from detjac.cli.options import ModelOptions
    from detjac.runs.plan import ModelSpec
    from detjac.runs.run import RunOptions

    shared = {f.name for f in fields(ModelSettings)}
    for kind in (ModelOptions, RunOptions, ModelSpec):
        assert issubclass(kind, ModelSettings) and shared <= {f.name for f in fields(kind)}
    o = ModelOptions(dtype="float32", max_memory="cpu=2GiB", gguf_file="x.gguf")
    assert RunOptions(**o.model_settings()).max_memory == "cpu=2GiB"
    assert "gguf_file" not in o.model_settings()


def test_a_model_reference_is_resolved_once_and_kept_portable(tmp_path):
    from detjac.engine import DEFAULT_MODEL_DIR, ModelRef
    from detjac.runs.plan import ModelSpec

    (tmp_path / "ckpt").mkdir()
    ref = ModelRef.resolve(str(tmp_path / "ckpt" / ".." / "ckpt"))
    assert ref.location == str((tmp_path / "ckpt").resolve()) and ref.name == str(tmp_path / "ckpt" / ".." / "ckpt")
    default = ModelRef.resolve("default")
    assert default.location == "default" and Path(default.source) == DEFAULT_MODEL_DIR  # each process finds its own
    assert ModelSpec("default").model == ModelRef("default", "default")  # a string is taken as given
    assert ModelSpec(ref).model is ref


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


def test_keep_is_parsed_once_into_the_run_description():
    from detjac.runs.description import RunDescription

    def described(keep: str) -> RunDescription:
        return RunDescription("m", "m", None, "llama", "0" * 64, "Llama", "float64", keep, True, -1, (), None, None, 8)

    assert described("rank:4").rank == 4 and described("full").rank is None and not described("none").keeps_jacobian
    assert "rank" not in described("rank:4").as_dict()  # the stored description is as it was
    with pytest.raises(InvalidArgumentError, match="Expected --keep full, --keep rank:K"):
        described("rank:0")


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


def test_a_prompts_reconstruction_errors_are_computed_in_the_prompt_pass_only():
    """Issue 63, item 2: the prompt pass accumulates every target's reconstruction from its blocks and computes the
    error; a run's batch and the Jacobian verb read them from its products instead of computing their own."""
    root = Path(__file__).resolve().parents[1]
    for path in ("runs/batch.py", "engine/verbs.py"):
        text = (root / path).read_text(encoding="utf-8")
        assert "relative_error" not in text and "einsum" not in text and "reconstruct(" not in text, path
    assert "relative_error(" in (root / "engine" / "prompt_products.py").read_text(encoding="utf-8")
