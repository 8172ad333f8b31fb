"""The tutorial notebooks (docs/notebooks/) are kept without outputs and run from top to bottom without an error
(nbclient, a python3 kernel: the ``test`` extra). Their cells assert what they show (exact reconstructions)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("*.ipynb"))
MISSING = [name for name in ("nbformat", "nbclient", "ipykernel") if importlib.util.find_spec(name) is None]
needs_jupyter = pytest.mark.skipif(bool(MISSING), reason=f"notebooks not run: {', '.join(MISSING)} not installed; "
                                                         "install with pip install -e '.[test]' (or make install)")


def test_there_are_two_tutorials() -> None:
    assert [p.name for p in NOTEBOOKS] == ["layers-and-steering.ipynb", "tour.ipynb"]


@needs_jupyter
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path: Path) -> None:
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code), \
        f"{path.name} has outputs: clear them before committing (jupyter nbconvert --clear-output --inplace)"


@pytest.mark.slow
@needs_jupyter
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_without_errors(path: Path, tmp_path: Path) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute(env={**os.environ, "TMPDIR": str(tmp_path)})  # what the notebook leaves shows here
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the plots were drawn
    streams = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "Warning" not in streams, streams[-2000:]  # no library warning (TqdmWarning: IProgress not found, ...)
    left = [p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith("torchinductor_")]  # torch's cache
    assert not left, f"the notebook left folders in the temp folder: {left}"
