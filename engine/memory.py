"""Memory budgets: the ``--max-memory`` syntax, device names and compute dtypes, and the allocator setting a CPU budget
needs.

Budgets are written as accelerate writes them (``"cuda:0=8GiB,cpu=32GiB"``). :func:`return_freed_memory` acts on the
whole process, so the engine never calls it: the application that owns the process does. Details: docs/engine.md,
"Two engines, one interface"."""

from __future__ import annotations

from typing import Any

from detjac.errors import InvalidArgumentError


def format_bytes(n_bytes: float) -> str:
    """A size in the largest binary unit it fills (``512 B``, ``3.0 KiB``, ``1.0 MiB``, ``1.50 GiB``), so that a
    message's numbers never read as zero.

    Parameters
    ----------
    n_bytes : float
        The size in bytes.

    Returns
    -------
    str
        The size with its unit (GiB with two decimals, the budgets' unit; KiB and MiB with one).
    """
    for unit, digits, scale in (("GiB", 2, 2**30), ("MiB", 1, 2**20), ("KiB", 1, 2**10)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.{digits}f} {unit}"
    return f"{n_bytes:.0f} B"


def parse_memory(text: str | None) -> dict[str, int]:
    """``"cuda:0=8GiB,cpu=32GiB"`` -> ``{"cuda:0": 8 * 2**30, "cpu": 32 * 2**30}``; empty or None -> ``{}``.

    Raises
    ------
    InvalidArgumentError
        Text that is not ``DEVICE=SIZE[,DEVICE=SIZE]``, or a device named twice.
    """
    from detjac.model_settings import parse_budgets

    budgets: dict[str, int] = {}
    for name, size in parse_budgets(text):
        device = device_key(name)
        if device in budgets:
            raise InvalidArgumentError(f"Expected each device once in --max-memory. Got {device} twice in {text!r}.")
        budgets[device] = size
    return budgets


def budgets_of(max_memory: dict[str, Any] | str | None) -> dict[str, int]:
    """Budgets in bytes by device key, from the ``--max-memory`` text or a dict of bytes."""
    if isinstance(max_memory, str) or max_memory is None:
        return parse_memory(max_memory)
    return {device_key(k): int(v) for k, v in max_memory.items()}


def device_key(device: Any) -> str:
    """``"cuda"`` -> ``"cuda:0"`` (as accelerate reads it), ``"CPU"`` -> ``"cpu"``."""
    import torch

    try:
        d = torch.device(str(device).strip().lower())
    except RuntimeError:
        raise InvalidArgumentError(f"Expected a torch device such as cpu, cuda or cuda:1. Got {device!r}.") from None
    return "cpu" if d.type == "cpu" else f"{d.type}:{d.index or 0}"


def compute_dtype(dtype: Any) -> Any:
    """The torch dtype every model source computes in: ``"float32"``, ``"torch.float32"`` or ``torch.float32`` (one
    parse, :func:`detjac.model_settings.dtype_name`).

    Raises
    ------
    InvalidArgumentError
        A string that names no compute dtype, or a value that is not a dtype.
    """
    import torch

    from detjac.model_settings import dtype_name

    return getattr(torch, dtype_name(dtype))


CUDA_BUILD = ('make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" '
              '(or pip install torch from the CUDA index at pytorch.org)')


def check_device(device: Any) -> str:
    """``device`` as a key (:func:`device_key`) once it is known that this PyTorch can compute there; else one line
    naming the devices it has and how to get the missing one (called before any model loads).

    Raises
    ------
    InvalidArgumentError
        A device name torch does not know, CUDA on a CPU-only build or a machine without a visible GPU, a CUDA
        index past the device count, MPS or another backend that is not available.
    """
    import torch

    key = device_key(device)
    kind, _, index = key.partition(":")
    if kind == "cpu":
        return key
    if kind == "cuda":
        if torch.version.cuda is None:
            raise InvalidArgumentError(
                f"Expected a device this PyTorch can compute on ({available_devices()}). Got {device!r}: this PyTorch "
                f"{torch.__version__} is a CPU-only build. For a CUDA build: {CUDA_BUILD}.")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidArgumentError(
                f"Expected a device this PyTorch can compute on ({available_devices()}). Got {device!r}: PyTorch "
                f"{torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device on this machine (check "
                "nvidia-smi and CUDA_VISIBLE_DEVICES).")
        if int(index or 0) >= count:
            raise InvalidArgumentError(
                f"Expected a CUDA device index below {count} ({available_devices()}). Got {device!r}.")
        return key
    backend = getattr(torch.backends, kind, None) or getattr(torch, kind, None)
    if backend is None or not getattr(backend, "is_available", lambda: False)():
        raise InvalidArgumentError(
            f"Expected a device this PyTorch can compute on ({available_devices()}). Got {device!r}: the {kind} "
            f"backend is not available in PyTorch {torch.__version__} on this machine.")
    return key


def available_devices() -> str:
    """The devices this PyTorch can compute on, as text: ``cpu``, ``cpu, cuda:0, cuda:1``, ``cpu, mps``."""
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return ", ".join(found)


def honour_cpu_budget(device: Any, max_memory: dict[str, Any] | str | None) -> bool:
    """:func:`return_freed_memory` when computing on ``device`` under a CPU budget in ``max_memory`` (the
    ``--max-memory`` text or budgets by device, as the engines take them); nothing otherwise. The one rule for the
    process's allocator: the application that owns the process calls it (the CLI from its options, a run's worker
    from its load spec), never the engine.

    Returns
    -------
    bool
        Whether the allocator was set.

    Raises
    ------
    InvalidArgumentError
        A device or budget that is not one.
    """
    if device_key(device) != "cpu" or "cpu" not in budgets_of(max_memory):
        return False
    return_freed_memory()
    return True


def return_freed_memory() -> None:
    """Make glibc hand large freed blocks back to the system at once (process-wide; call it from the application).

    glibc raises its mmap threshold each time a large block is freed, after which blocks of
    that size come from the heap and freed ones stay resident: the sweeps, which allocate
    and free the same large cotangent buffers for every layer, then grow the resident set
    to several times what they use (measured: 7-12 MiB per cotangent vector instead of
    under 1.5 MiB). A fixed threshold keeps a CPU budget honest. The price is page faults on
    every new buffer (measured 1.0-1.45x the time of a sweep on 2 CPU cores with 4 KiB pages),
    so without a budget the default allocator is kept. No-op off glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: blocks >= 1 MiB are mmapped, freed at once
    except OSError:
        pass

