"""The one error hierarchy of detjac.

Every error a user can act on derives from :class:`DetjacError` and also from the
builtin exception it specializes, so ``except ValueError`` keeps working for callers
that do not know about detjac. The CLI turns any ``DetjacError`` into a clean message
and a non-zero exit code; anything else is a bug and keeps its traceback.
"""


class DetjacError(Exception):
    """Base class of every error detjac raises on purpose."""


class UnsupportedModelError(DetjacError, ValueError):
    """The model's family, or a module on its input-to-output path, has no detach rule."""


class CheckpointError(DetjacError, OSError):
    """A path that should hold a Hugging Face checkpoint does not."""


class PromptError(DetjacError, ValueError):
    """A prompt is empty, too long for the model, or otherwise unusable."""


class LinearizationError(DetjacError, RuntimeError):
    """The detached model failed to reproduce its own output (a nonlinearity escaped)."""


class InvalidArgumentError(DetjacError, ValueError):
    """An argument other than the prompt or the model is out of its range (row_block, target, ...)."""


class StoreError(DetjacError, OSError):
    """A Jacobian store cannot be created, opened, written or read as asked."""


class StoreFormatError(StoreError):
    """A path is not a detjac store, or one written in a format this version cannot read."""


class StoreMismatchError(StoreError):
    """Resuming a store written for another model, dtype or settings."""


class PromptsFileError(DetjacError, ValueError):
    """A prompts file is missing, unreadable, empty or malformed."""


class WorkerError(DetjacError, RuntimeError):
    """A worker of a distributed run cannot do its part: load the model, or reach the store."""


class UnreadableJSONError(DetjacError, ValueError):
    """Text that should be JSON is not, or holds what no detjac file does: values nested too deep for the parser,
    an integer of more digits than any count, a non-finite number (``detjac.safe_json``)."""


class OutputError(DetjacError, OSError):
    """An output file (a graph JSON, a table) cannot be written: the disk is full, read-only, ..."""
