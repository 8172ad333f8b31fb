"""The zarr v3 directory backend, reading one prompt: its group opened read-only, and its verification.

A complete prompt is the group ``prompts/<id>`` of the store folder (``docs/store-format.md``);
this module only reads it. :func:`verify_prompt` decodes every chunk (each carries a crc32c)
and checks that the Jacobians still reconstruct what they were stored with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, StoreError
from ..exactness import DTYPE_BOUND, FLOAT64_EXACTNESS_BOUND, relative_error
from ..targets import Target
from . import format as fmt
from .base import StoredPrompt, VerifyResult


class ZarrPrompt(StoredPrompt):
    """A complete prompt group, opened read-only."""

    def __init__(self, path: Path) -> None:
        import zarr

        self.path = path
        self.id = path.name
        self._group = zarr.open_group(str(path), mode="r")
        self.attrs = dict(self._group.attrs)

    def _full(self) -> Any:
        if self.low_rank:
            raise StoreError(f"Prompt {self.id} was stored in low-rank mode ({self.attrs.get('keep')}): it has no "
                             "full Jacobian. Use prompt.triplets(k) for token k or prompt.triplets() for all tokens.")
        return self._group["jacobian"]

    def triplets(self, k: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.low_rank:
            raise StoreError(f"Prompt {self.id} holds the full Jacobian, not triplets; use jacobian() or operator().")
        if k is None:
            return tuple(self._group[f"combined_{x}"][...] for x in "USV")  # type: ignore[return-value]
        n = self.n_tokens
        if not -n <= k < n:
            raise InvalidArgumentError(f"Expected a token index in [-{n}, {n}) for prompt {self.id}. Got {k}.")
        return tuple(self._group[f"token_{x}"][k % n] for x in "USV")  # type: ignore[return-value]

    def jacobian(self, lazy: bool = True) -> Any:
        arr = self._full()
        if lazy:
            import dask.array as da

            return da.from_zarr(arr)
        return arr[...]

    def operator(self, k: int) -> np.ndarray:
        n = self.n_tokens
        if not -n <= k < n:
            raise InvalidArgumentError(f"Expected a token index in [-{n}, {n}) for prompt {self.id}. Got {k}.")
        return self._full()[:, k % n, :]

    @property
    def layerwise_targets(self) -> list[str]:
        if fmt.LAYERWISE not in self._group:
            return []
        return sorted(self._group[fmt.LAYERWISE].group_keys(), key=Target.parse)

    def layerwise(self, target: str, array: str = "jacobian", lazy: bool = True) -> Any:
        if target not in self.layerwise_targets:
            raise InvalidArgumentError(f"Expected a layerwise target of prompt {self.id} "
                                       f"({', '.join(self.layerwise_targets) or 'none stored'}). Got {target!r}.")
        group = self._group[f"{fmt.LAYERWISE}/{target}"]
        if array not in group.array_keys():
            raise InvalidArgumentError(f"Expected one of {', '.join(sorted(group.array_keys()))} for {target}. "
                                       f"Got {array!r}.")
        if array == "jacobian" and lazy:
            import dask.array as da

            return da.from_zarr(group[array])
        return group[array][...]

    def layerwise_info(self, target: str) -> dict[str, Any]:
        self.layerwise(target, "output")
        return {**dict(self._group[f"{fmt.LAYERWISE}/{target}"].attrs),
                **self.attrs.get("layerwise", {}).get(target, {})}

    def array(self, name: str) -> np.ndarray:
        names = sorted(set(self._group.array_keys()) - {"jacobian"})
        if name not in names:
            raise InvalidArgumentError(f"Expected one of {', '.join(names)}. Got {name!r}.")
        return self._group[name][...]


def verify_prompt(path: Path) -> VerifyResult:
    """Decode every chunk (crc32c is checked on read) and recompute the reconstruction error."""
    pid = path.name
    try:
        prompt = ZarrPrompt(path)
        if prompt.low_rank:
            return _verify_low_rank(prompt)
        arr = prompt._group["jacobian"]
        x = prompt.array("embeddings").astype(np.float64)
        y = prompt.array("output").astype(np.float64)
        recon = np.empty_like(y)
        step = arr.chunks[0]
        for start in range(0, arr.shape[0], step):
            block = arr[start:start + step].astype(np.float64)  # (rows, token, col)
            recon[start:start + step] = np.einsum("rtc,tc->r", block, x)
        if "bias" in prompt._group.array_keys():  # an affine model: y = sum_k J_k x_k + b
            recon += prompt.array("bias").astype(np.float64)
    except Exception as exc:  # noqa: BLE001 - any decode failure means the prompt is corrupt
        return VerifyResult(pid, False, None, f"unreadable: {type(exc).__name__}: {exc}")
    error = relative_error(recon, y)
    stored = float(prompt.attrs.get("reconstruction_error", 0.0))
    bound = DTYPE_BOUND.get(prompt.attrs.get("dtype", "float64"), FLOAT64_EXACTNESS_BOUND)
    for target in prompt.layerwise_targets:  # each reconstructs its own output, within the same bound
        try:
            t_error = _layerwise_error(prompt, target, x)
        except Exception as exc:  # noqa: BLE001
            return VerifyResult(pid, False, error, f"layerwise {target} unreadable: {type(exc).__name__}: {exc}")
        t_stored = float(prompt.attrs.get("layerwise", {}).get(target, {}).get("reconstruction_error", 0.0))
        t_bound = max(bound, 10 * t_stored)
        if prompt.attrs.get("detached") is not False and (not np.isfinite(t_error) or t_error > t_bound):
            return VerifyResult(pid, False, error, f"layerwise {target}: reconstruction error {t_error:.3e} "
                                                   f"above {t_bound:.1e}")
    if prompt.attrs.get("detached") is False:  # an ordinary Jacobian: it must reproduce its stored error
        if not np.isfinite(error) or abs(error - stored) > bound * max(1.0, stored):
            return VerifyResult(pid, False, error, f"reconstruction error {error:.3e} differs from the stored "
                                                   f"{stored:.3e}")
        return VerifyResult(pid, True, error)
    bound = max(bound, 10 * stored)
    if not np.isfinite(error) or error > bound:
        return VerifyResult(pid, False, error, f"reconstruction error {error:.3e} above {bound:.1e}")
    return VerifyResult(pid, True, error)


def _layerwise_error(prompt: ZarrPrompt, target: str, embeddings: np.ndarray) -> float:
    """``|| sum_k J_k x_k - output || / || output ||`` of one layerwise target, chunk by chunk."""
    arr = prompt._group[f"{fmt.LAYERWISE}/{target}/jacobian"]
    source = Target.parse(target).source_array
    x = prompt.layerwise(target, source).astype(np.float64) if source is not None else embeddings
    y = prompt.layerwise(target, "output").astype(np.float64)
    recon = np.zeros_like(y)
    rows, tokens = arr.chunks[0], arr.chunks[1]
    for r in range(0, arr.shape[0], rows):
        for k in range(0, arr.shape[1], tokens):
            block = arr[r:r + rows, k:k + tokens].astype(np.float64)
            recon[r:r + rows] += np.einsum("rtc,tc->r", block, x[k:k + tokens])
    return relative_error(recon, y)


def _verify_low_rank(prompt: ZarrPrompt) -> VerifyResult:
    """Decode every array (checksums); singular values finite, non-negative, descending, not above the energy."""
    arrays = {name: prompt._group[name][...] for name in prompt._group.array_keys()}
    for name in ("token_S", "combined_S"):
        s = arrays[name].astype(np.float64)
        if not np.all(np.isfinite(s)) or np.any(s < 0) or np.any(np.diff(s, axis=-1) > 1e-12 * s.max(initial=1)):
            return VerifyResult(prompt.id, False, None, f"{name} is not a valid descending spectrum")
    energy = (arrays["token_S"].astype(np.float64) ** 2).sum(-1)
    if np.any(energy > arrays["token_frobenius_sq"] * (1 + 1e-6) + 1e-300):
        return VerifyResult(prompt.id, False, None, "singular values exceed the stored Frobenius norms")
    return VerifyResult(prompt.id, True, None)
