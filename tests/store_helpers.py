"""Helpers shared by the store tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from detjac.store import StoreComparison, compare_stores, open_store
from detjac.store.compare import TIMESTAMPS

PROMPTS = [
    "Kitten, n. A young cat.",
    "Oak, n. (Bot.) Any tree of the genus Quercus.",
    "Bread, n. An article of food made from flour.",
    "Violin, n. (Mus.) A small stringed instrument.",
    "Copper, n. (Chem.) A common metal of a reddish color.",
    "Whale, n. (Zool.) Any aquatic mammal of the order Cetacea.",
    "Harp, n. (Mus.) A stringed instrument played with the fingers.",
    "Arrogance, n. The act or habit of making undue claims.",
]


def write_prompts(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_default(folder: Path, lines: list[str], name: str, *options: str) -> Any:
    """``detjac run default`` over ``lines`` into ``folder/name`` (with ``options``); the store, opened."""
    from click.testing import CliRunner

    from detjac.cli.main import main

    prompts = write_prompts(folder / f"{name}.txt", lines)
    result = CliRunner().invoke(main, ["run", "default", str(prompts), "--out", str(folder / name), *options])
    assert result.exit_code == 0, result.output
    return open_store(folder / name)


def store_snapshot(path: Path) -> dict:
    """Every array's bytes and every attribute except timestamps, per prompt id."""
    st = open_store(path)
    snap = {"run": st.run}
    for prompt in st:
        arrays = {name: prompt.array(name) for name in ("embeddings", "output", "token_ids")}
        if not prompt.without_jacobian:  # a --lens prompt keeps none
            arrays["jacobian"] = prompt.jacobian(lazy=False)
        attrs = {k: v for k, v in prompt.attrs.items() if k not in TIMESTAMPS}
        snap[prompt.id] = (attrs, {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in arrays.items()})
    return snap


def assert_same_store(a: Path, b: Path) -> None:
    """The same bits: for one command run twice with the same settings on the same machine (a resume after a kill, a
    rerun). Stores computed in other processes, thread counts or engines are compared by
    :func:`assert_equivalent_store`, since BLAS rounds differently there."""
    sa, sb = store_snapshot(a), store_snapshot(b)
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert sa[key] == sb[key], key


def assert_equivalent_store(a: Path, b: Path) -> StoreComparison:
    """Two stores of the same run computed in different processes, thread counts or engines: equivalent within
    rounding (:func:`detjac.store.compare_stores`, which says what that means); what it saw."""
    seen = compare_stores(a, b)
    assert seen.equivalent, "Expected equivalent stores. Got:\n  " + "\n  ".join(seen.differences)
    return seen


def assert_all_equal(x: np.ndarray, y: np.ndarray) -> None:
    assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)


def reseal(folder: Path) -> None:
    """Recompute the integrity record of a damaged group, as a writer would have: the damage then reaches the
    checks behind the seal (chunk checksums, reconstruction, spectra)."""
    import json

    from detjac.store.integrity import INTEGRITY, seal

    meta_file = folder / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["attributes"][INTEGRITY] = seal(folder, meta["attributes"])
    meta_file.write_text(json.dumps(meta))
