"""A neuron index resealed with other identity keys or arrays, as a hostile user or another tool could write it:
the seal matches, the content lies."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from detjac.store import read_sealed, write_sealed
from detjac.store.neuron_index import DIMS, GROUP


def resealed(index: Path, dest: Path, identity: dict[str, Any] | None = None,
             arrays: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of the index at ``index`` at ``dest``, its sealed group rewritten with ``identity`` keys and
    ``arrays`` replaced, and sealed again."""
    shutil.copytree(index, dest)
    found, attrs = read_sealed(dest / GROUP, "a test's neuron index")
    if identity:
        attrs["identity"].update(identity)
    attrs.pop("written_at", None)
    write_sealed(dest, GROUP, {**found, **(arrays or {})}, attrs, "reseal a test's neuron index", DIMS)
    return dest
