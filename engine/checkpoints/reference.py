"""MODEL resolved once, at the boundary, into a :class:`ModelRef` that is passed down as it is: the layers below
never resolve it again (what a MODEL argument names: :mod:`detjac.model_names`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from detjac.errors import CheckpointError
from detjac.model_names import DEFAULT_MODEL_NAME, missing_gguf, model_kind

from .hub import resolve_hub_file, resolve_hub_id
from .names import default_model_dir


@dataclass(frozen=True)
class ModelRef:
    """MODEL resolved once, at the boundary (:meth:`resolve`), and passed down as it is.

    ``name``: MODEL as given (with ``--gguf-file``, that file's path), which a run records as its ``model_id``;
    ``location``: where every process finds it (a folder or file as an absolute path, a hub id's snapshot folder in the
    Hugging Face cache; ``default`` kept as a name, since each process finds the shipped model in its own
    installation); ``revision``: the hub revision it was resolved at; ``kind``: what MODEL named
    (:func:`detjac.model_names.model_kind`: ``default``, ``gguf``, ``folder`` or ``hub``), which the loaders read
    instead of asking the file system again."""

    name: str
    location: str
    revision: str | None = None
    kind: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.kind:  # built by hand from a location: what it names is read from it, once, here
            object.__setattr__(self, "kind", model_kind(self.location))

    @classmethod
    def resolve(cls, model: str | Path, gguf_file: str | None = None, revision: str | None = None) -> ModelRef:
        """``model`` (and ``--gguf-file``) resolved: what it names decided (:func:`~detjac.model_names.model_kind`),
        a hub id found in the Hugging Face cache (or downloaded), once, here.

        Raises
        ------
        CheckpointError
            A path that does not exist; a hub id that is not in the cache and cannot be downloaded; a GGUF file that
            is not there."""
        kind, text = getattr(model, "kind", None), str(model)  # MODEL parsed by the CLI: decided already
        if kind is None or (gguf_file is not None and kind not in ("hub", "folder")):
            kind = model_kind(model, gguf_file)
        if gguf_file is not None:
            file = gguf_in(model, gguf_file, revision, hub=kind == "hub")
            return cls(str(file), str(Path(file).resolve()), revision, "gguf")
        if kind == "hub":
            return cls(text, str(resolve_hub_id(text, revision)), revision, kind)
        if kind == "default":
            return cls(text, DEFAULT_MODEL_NAME, revision, kind)
        return cls(text, str(Path(text).expanduser().resolve()), revision, kind)

    @classmethod
    def of(cls, model: ModelRef | str | Path, revision: str | None = None) -> ModelRef:
        """``model`` as a reference: a :class:`ModelRef` as it is, a string or path resolved (:meth:`resolve`): the
        Python API's public entries take either."""
        return model if isinstance(model, ModelRef) else cls.resolve(model, revision=revision)

    @property
    def source(self) -> Path:
        """The folder or file the loaders read: ``location``, or for ``default`` the shipped model's folder."""
        return default_model_dir() if self.kind == "default" else Path(self.location)

    @property
    def is_gguf(self) -> bool:
        """Whether it is a GGUF file (its config, tokenizer and weights read from the one file)."""
        return self.kind == "gguf"


def gguf_path(source: str | Path, gguf_file: str | None = None) -> Path:
    """The GGUF file that ``source`` (a file, or a folder holding ``gguf_file``) names, checked to exist.

    Raises
    ------
    CheckpointError
        The file does not exist, or ``gguf_file`` is not a plain file name inside the folder.
    """
    base = Path(source).expanduser()
    if gguf_file is not None:
        _check_file_name(gguf_file)
        if not base.is_dir():
            raise CheckpointError(f"Expected a folder (or hub id) holding {gguf_file} with --gguf-file. Got "
                                  f"{str(source)!r}, which is not a folder.")
        base = base / gguf_file
    if not base.is_file():
        raise missing_gguf(base)
    return base


def gguf_in(source: str | Path, gguf_file: str, revision: str | None, hub: bool) -> Path:
    """The GGUF file ``gguf_file`` inside the folder, or the hub repository (``hub``), ``source``."""
    if hub:
        _check_file_name(gguf_file)
        return resolve_hub_file(str(source), gguf_file, revision)
    return gguf_path(source, gguf_file)


def _check_file_name(gguf_file: str) -> None:
    """Refuse a ``--gguf-file`` that is a path rather than a file name (it could reach outside the folder)."""
    if Path(gguf_file).name != gguf_file or gguf_file in ("", ".", ".."):
        raise CheckpointError(f"Expected --gguf-file to name a file inside the model folder (a plain file name "
                              f"such as model.Q4_K_M.gguf). Got {gguf_file!r}.")


def resolve_model(source: str | Path, gguf_file: str | None = None, revision: str | None = None) -> str | Path:
    """The Python API's shorthand for a MODEL's path: ``"default"`` names the shipped model's folder (unless a folder
    of that name exists); with ``gguf_file``, the GGUF file of that name inside the folder or hub id ``source`` (as
    :meth:`ModelRef.resolve` finds it); else ``source`` unchanged."""
    if gguf_file is not None:
        return ModelRef.resolve(source, gguf_file, revision).source
    if str(source) == DEFAULT_MODEL_NAME and not Path(source).exists():
        return default_model_dir()
    return source
