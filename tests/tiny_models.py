"""Tiny random models of every family, built from configs (no network): constants and fixtures.

The conftest.py of each folder whose tests need torch re-exports the fixtures; the store and
analysis tests do not import this module, so they run without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from detjac.engine.checkpoints.tiny import WINDOW, save_tiny_checkpoint, tiny_config, tiny_model, tiny_model_types
from detjac.engine.families import family_for
from detjac.targets import Target

FAMILIES = tiny_model_types()
STREAMABLE = [t for t in FAMILIES if family_for(tiny_config(t)).streamable]
AFFINE = [t for t in FAMILIES if family_for(tiny_config(t)).affine]
N_TOKENS = 3 * WINDOW + 1  # longer than every sliding window in the tiny configs


@pytest.fixture(scope="session")
def prompt_ids() -> list[int]:
    return torch.randint(3, 160, (N_TOKENS,), generator=torch.Generator().manual_seed(1234)).tolist()


@pytest.fixture(params=FAMILIES)
def family_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny_model(request.param, seed=7)


@pytest.fixture(params=STREAMABLE)
def streamable_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny_model(request.param, seed=7)


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama")


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: with tiny tensors a second thread only adds synchronization, which
    costs 10x on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Swept:
    """One prompt pass's Jacobians (:func:`detjac.engine.prompt_pass`, assembled whole), looked up by target name or
    :class:`~detjac.targets.Target`, with each target's reconstruction error as the pass computed it."""

    def __init__(self, products: Any) -> None:
        self.products, self.trace, self.plan, self.jacobians = (products, products.trace, products.plan,
                                                                products.jacobians)

    def _target(self, name: str | Target) -> Target:
        return name if isinstance(name, Target) else next(t for t in self.jacobians if t.name == name)

    def __getitem__(self, name: str | Target) -> torch.Tensor:
        return self.jacobians[self._target(name)]

    def reconstruction_error(self, name: str | Target) -> float:
        return self.products.errors[self._target(name)]


def swept(engine: Any, prompt: Any, targets: Sequence[str | Target], **options: Any) -> Swept:
    """``prompt_pass(engine, prompt, targets, **options)`` with targets given by name (``"layer.1"``) too."""
    from detjac.engine import prompt_pass

    wanted = [t if isinstance(t, Target) else Target.parse(t, engine.n_layers) for t in targets]
    return Swept(prompt_pass(engine, prompt, wanted, **options))
