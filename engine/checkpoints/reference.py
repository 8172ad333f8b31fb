"""MODEL resolved once, at the boundary, into a :class:`ModelRef` that is passed down as it is: the layers below
never resolve it again (what a MODEL argument names: :mod:`detjac.model_names`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from detjac.model_names import DEFAULT_MODEL_NAME, model_kind

from .hub import resolve_hub_id
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
        kind, text = model_kind(model, gguf_file), str(model)
        if gguf_file is not None:
            from .gguf import gguf_in

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
