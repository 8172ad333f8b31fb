"""MODEL resolved once, at the boundary, into a :class:`ModelRef` that is passed down as it is: the layers below
never resolve it again (what a MODEL argument names: :mod:`.names`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .hub import is_hub_id
from .loading import check_checkpoint_dir
from .names import resolve_model


@dataclass(frozen=True)
class ModelRef:
    """MODEL resolved once, at the boundary (:meth:`resolve`), and passed down as it is.

    ``name``: MODEL as given (with ``--gguf-file``, that file's path), which a run records as its ``model_id``;
    ``location``: where every process finds it (a folder or file as an absolute path, a hub id's snapshot folder in the
    Hugging Face cache; ``default`` kept as a name, since each process finds the shipped model in its own
    installation); ``revision``: the hub revision it was resolved at."""

    name: str
    location: str
    revision: str | None = None

    @classmethod
    def resolve(cls, model: str | Path, gguf_file: str | None = None, revision: str | None = None) -> ModelRef:
        """``model`` (and ``--gguf-file``) resolved: a hub id found in the Hugging Face cache (or downloaded), once,
        here.

        Raises
        ------
        CheckpointError
            A hub id that is not in the cache and cannot be downloaded; a GGUF file that is not there."""
        name = str(model) if gguf_file is None else str(resolve_model(model, gguf_file, revision))
        return cls(name, portable_location(name, revision), revision)

    @classmethod
    def as_given(cls, model: ModelRef | str | Path) -> ModelRef:
        """``model`` as a reference; a string is taken as it is (``name`` and ``location``), unresolved."""
        return model if isinstance(model, ModelRef) else cls(str(model), str(model))

    @property
    def source(self) -> str | Path:
        """What the loaders take: ``location``, or for ``default`` the shipped model's folder (nothing is read)."""
        return resolve_model(self.location)


def portable_location(model: str, revision: str | None = None) -> str:
    """A checkpoint folder or file as an absolute path (workers resolve it on their own file system), a hub id as its
    snapshot folder in the Hugging Face cache (found, or downloaded, once, here); else unchanged."""
    if is_hub_id(model):
        return str(check_checkpoint_dir(model, revision))
    path = Path(model)
    return str(path.resolve()) if path.is_dir() or path.is_file() else model  # a folder or a GGUF file
