"""The run description: what identifies a corpus run (checked when a store is resumed, hashed into prompt ids) and
its other settings, as one frozen value; the store keeps it as the JSON object :meth:`RunDescription.as_dict`."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detjac import __version__

if TYPE_CHECKING:
    from detjac.engine import Engine

AUTO = "auto"  # the stored row_block of a run whose engine sizes its own blocks


@dataclass(frozen=True)
class StreamedSettings:
    """What a run on the layer-streamed engine adds: its layerwise targets, quantizing, mode and memory budget."""

    layerwise: tuple[str, ...] = ()
    quantize: str | None = None
    mode: str = "auto"
    max_memory: str | None = None


@dataclass(frozen=True)
class RunDescription:
    """One run's model, settings and identity. ``row_block`` None: each prompt's engine picks (stored ``"auto"``);
    ``fingerprint``: the weight and tokenizer files' digests (:func:`detjac.runs.fingerprint.weights_identity`);
    ``lens``: a ``--lens`` run's layers and settings (:func:`detjac.runs.lens_run.lens_description`)."""

    model_id: str
    model_path: str
    revision: str | None
    model_type: str
    config_sha256: str
    family: str
    dtype: str
    keep: str
    detach: bool
    position: int
    detach_rules: tuple[str, ...]
    convention: str | None
    row_block: int | None
    max_tokens: int
    target: str = "hidden"
    detjac_version: str = __version__
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    lens: Mapping[str, Any] | None = None
    streamed: StreamedSettings | None = None

    @property
    def mode(self) -> str:
        """How the engine splits the targets (``auto``, ``reverse``, ``forward``): a streamed run's choice."""
        return self.streamed.mode if self.streamed is not None else "auto"

    def as_dict(self) -> dict[str, Any]:
        """The JSON object a store keeps as its ``run`` (and prompt ids hash), key for key."""
        out: dict[str, Any] = {
            "model_id": self.model_id, "model_path": self.model_path, "revision": self.revision,
            "model_type": self.model_type, "config_sha256": self.config_sha256, "dtype": self.dtype,
            "keep": self.keep, "detach": self.detach, "position": self.position, "target": self.target,
            "family": self.family, "detach_rules": list(self.detach_rules), "convention": self.convention,
            "row_block": AUTO if self.row_block is None else self.row_block, "max_tokens": self.max_tokens,
            "detjac_version": self.detjac_version, **self.fingerprint, "lens": self.lens}
        if self.streamed is not None:
            s = self.streamed
            out.update({"engine": "streamed", "layerwise": list(s.layerwise), "quantize": s.quantize, "mode": s.mode,
                        "max_memory": s.max_memory})
        return out


def describe_run(engine: Engine, model_arg: str, model_dir: Path | None, revision: str | None, dtype: str,
                 row_block: int | None, max_tokens: int, keep: str = "full", convention: str | None = None
                 ) -> RunDescription:
    """The description of a run of ``engine`` (loaded from ``model_arg``, found at ``model_dir``). ``convention`` is
    the family's detach convention when it is not its default (None: the default, which leaves prompt ids as they
    were)."""
    from detjac.engine import is_hub_id

    config_file = model_dir / "config.json" if model_dir is not None and model_dir.is_dir() else None
    config_sha = (hashlib.sha256(config_file.read_bytes()).hexdigest()
                  if config_file is not None and config_file.is_file()
                  else hashlib.sha256(engine.config.to_json_string().encode()).hexdigest())
    family = engine.family
    hub = is_hub_id(model_arg)  # the id names the model; model_path, its snapshot folder, names the commit
    return RunDescription(
        model_id=model_dir.name if model_dir is not None and not hub else model_arg,
        model_path=str(model_dir.resolve()) if model_dir is not None else model_arg, revision=revision,
        model_type=engine.config.model_type, config_sha256=config_sha, family=family.name, dtype=dtype, keep=keep,
        detach=engine.detach, position=family.default_position,
        detach_rules=tuple(family.describe(convention)) if engine.detach else (), convention=convention,
        row_block=row_block, max_tokens=max_tokens)
