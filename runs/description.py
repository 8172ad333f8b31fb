"""The run description: what identifies a corpus run (checked when a store is resumed, hashed into prompt ids) and
its other settings, as one frozen value; the store keeps it as the JSON object :meth:`RunDescription.as_dict`."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detjac import __version__
from detjac.graph_settings import GraphSettings

if TYPE_CHECKING:
    from detjac.engine import Engine
    from detjac.store import Keep

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
    ``lens``: a ``--lens`` run's layers and settings (:func:`detjac.runs.lens_run.lens_description`); ``graph``: a
    ``--graph`` run's settings (kept as :meth:`~detjac.graph_settings.GraphSettings.stored`), each prompt then stored
    with its attribution graph."""

    model_id: str
    model_path: str
    revision: str | None
    model_type: str
    config_sha256: str
    family: str
    dtype: str
    keep: Keep  # --keep's text is parsed into it (:meth:`detjac.store.Keep.parse`) when it is given as text
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
    graph: GraphSettings | None = None  # `--graph` (None: no graph)
    n_layers: int | None = None  # the model's layer count (not part of the identity): a lens fitted here records it

    def __post_init__(self) -> None:
        from detjac.store import Keep

        if not isinstance(self.keep, Keep):  # parsed once: a Keep (check_options's) is kept as it is
            object.__setattr__(self, "keep", Keep.parse(self.keep))

    @property
    def rank(self) -> int | None:
        """``--keep rank:K``'s K, else None."""
        return self.keep.rank

    @property
    def keeps_jacobian(self) -> bool:
        """Whether each prompt keeps the output's Jacobian (whole or as triplets): all but ``--keep none``."""
        return self.keep.jacobian

    @property
    def mode(self) -> str:
        """How the engine splits the targets (``auto``, ``reverse``, ``forward``): a streamed run's choice."""
        return self.streamed.mode if self.streamed is not None else "auto"

    def as_dict(self) -> dict[str, Any]:
        """The JSON object a store keeps as its ``run`` (and prompt ids hash), key for key."""
        out: dict[str, Any] = {
            "model_id": self.model_id, "model_path": self.model_path, "revision": self.revision,
            "model_type": self.model_type, "config_sha256": self.config_sha256, "dtype": self.dtype,
            "keep": str(self.keep), "detach": self.detach, "position": self.position, "target": self.target,
            "family": self.family, "detach_rules": list(self.detach_rules), "convention": self.convention,
            "row_block": AUTO if self.row_block is None else self.row_block, "max_tokens": self.max_tokens,
            "detjac_version": self.detjac_version, **self.fingerprint, "lens": self.lens}
        if self.graph is not None:  # absent otherwise: the runs description of a store without graphs is unchanged
            out["graph"] = self.graph.stored()
        if self.n_layers is not None:
            out["n_layers"] = self.n_layers
        if self.streamed is not None:
            s = self.streamed
            out.update({"engine": "streamed", "layerwise": list(s.layerwise), "quantize": s.quantize, "mode": s.mode,
                        "max_memory": s.max_memory})
        return out


def describe_run(engine: Engine, model_arg: str, model_dir: Path | None, revision: str | None, dtype: str,
                 row_block: int | None, max_tokens: int, keep: Keep | str = "full", convention: str | None = None, *,
                 hub: bool = False) -> RunDescription:
    """The description of a run of ``engine`` (loaded from ``model_arg``, found at ``model_dir``; ``hub``: a hub id,
    :attr:`detjac.engine.ModelRef.kind`). ``convention`` is the family's detach convention when it is not its default
    (None: the default, which leaves prompt ids as they were)."""
    config_sha = config_digest(engine.config, model_dir)
    family = engine.family
    # a hub id names the model; model_path, its snapshot folder, names the commit
    return RunDescription(
        model_id=model_dir.name if model_dir is not None and not hub else model_arg,
        model_path=str(model_dir.resolve()) if model_dir is not None else model_arg, revision=revision,
        model_type=engine.config.model_type, config_sha256=config_sha, family=family.name, dtype=dtype, keep=keep,
        detach=engine.detach, position=family.default_position,
        detach_rules=tuple(family.describe(convention)) if engine.detach else (), convention=convention,
        row_block=row_block, max_tokens=max_tokens, n_layers=int(engine.n_layers))


# What a loaded config records of how this engine loaded it, not of the model: the in-memory engine's config says
# the dtype it computes in (the run's own dtype field records that), the streamed engine's does not.
LOADING_KEYS = ("dtype", "torch_dtype", "_name_or_path")


def config_digest(config: Any, model_dir: Path | None) -> str:
    """The ``config_sha256`` of a run: the SHA-256 of the checkpoint's ``config.json`` where the model has one,
    else (a GGUF file, a model given as an object) of the config as JSON without what the engine adds on loading
    (:data:`LOADING_KEYS`), so that one model file has one run identity whichever engine reads it.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The engine's config.
    model_dir : Path or None
        Where the model was found (a folder, a GGUF file), None when it has no place on disk.

    Returns
    -------
    str
        64 hex digits.
    """
    import json

    config_file = model_dir / "config.json" if model_dir is not None and model_dir.is_dir() else None
    if config_file is not None and config_file.is_file():
        return hashlib.sha256(config_file.read_bytes()).hexdigest()
    fields = {k: v for k, v in json.loads(config.to_json_string()).items() if k not in LOADING_KEYS}
    return hashlib.sha256((json.dumps(fields, indent=2, sort_keys=True) + "\n").encode()).hexdigest()


# The run identity's keys as the options a user sets (`detjac run ... --dtype float32`), for a refused resume.
OPTION_OF = {"dtype": "--dtype", "keep": "--keep", "detach": "--ordinary", "layerwise": "--layers/--components",
             "quantize": "--quantize", "convention": "--convention", "lens": "--lens", "revision": "--revision",
             "graph": "--graph"}
# The keys that say which model ran: a difference in any of them is a different MODEL.
MODEL_KEYS = {"model_id": "its name", "model_type": "its family", "config_sha256": "its configuration",
              "weights_sha256": "its weights", "tokenizer_sha256": "its tokenizer"}


def setting_differences(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """How a run differs from the run a store was written by, in the words a user set: the options
    (``--dtype float32 here, --dtype float64 in the store``) and the model (``MODEL ... : its weights differ``).

    Parameters
    ----------
    stored, wanted : Mapping
        The store's ``run`` and this run's (:meth:`RunDescription.as_dict`).

    Returns
    -------
    list[str]
        One phrase per differing setting; empty when only keys no user sets differ (a target, a position).
    """
    said = [f"{_said(key, wanted.get(key))} here, {_said(key, stored.get(key))} in the store"
            for key in OPTION_OF if (stored.get(key) or None) != (wanted.get(key) or None)]  # unset == absent
    model = [what for key, what in MODEL_KEYS.items()
             if stored.get(key) and wanted.get(key) and stored[key] != wanted[key]]
    if model:
        said.append(f"MODEL {wanted.get('model_id')} here, {stored.get('model_id')} in the store: "
                    f"{', '.join(model)} differ")
    return said


def _said(key: str, value: Any) -> str:
    """A run setting as the option that gives it (``--keep rank:4``, ``no --ordinary``, ``no --quantize``)."""
    option = OPTION_OF[key]
    if key == "detach":
        return "no --ordinary" if value else "--ordinary"
    if key == "lens":
        return "--lens" if value else "no --lens"
    if key == "graph":
        return (f"--graph --graph-max-nodes {value['max_nodes']} --graph-node-threshold {value['node_threshold']} "
                f"--graph-edge-threshold {value['edge_threshold']}" if value else "no --graph")
    if key == "layerwise":
        return f"--layers giving {', '.join(value)}" if value else "no --layers"
    return f"{option} {value}" if value not in (None, "", []) else f"no {option}"
