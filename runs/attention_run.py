"""Attention files of several heads of one prompt in one model load: ``detjac attention --graph G --top-heads N``,
and ``detjac graph --attention-pages N`` after its graph is written.

Every target file is checked (:func:`detjac.outputs.check_output`) and every head against the model before the first
head is computed, and the prompt's tokens against the graph's before the first file is written; each file is then
written as soon as its head is computed (aside, then renamed), so a run stopped midway leaves the whole files of the
heads done and nothing half-written. Files are named as ``detjac view STEM.json`` finds them beside the graph
(:func:`detjac.attention_names.attention_file_name`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from detjac.attention_names import attention_file_name
from detjac.errors import InvalidArgumentError
from detjac.outputs import check_output
from detjac.progress import tqdm

__all__ = ["attention_pages", "attention_targets"]


def attention_targets(folder: str | Path, stem: str, heads: Sequence[tuple[int, int]], *, force: bool = False,
                      reads: Sequence[tuple[str, str | Path]] = ()) -> list[Path]:
    """The attention files :func:`attention_pages` writes for ``heads`` into ``folder``, each checked by
    :func:`~detjac.outputs.check_output` (a command calls this before it loads the model, so a refusal costs
    nothing).

    Raises
    ------
    InvalidArgumentError
        No heads, ``folder`` is not an existing folder, or a file is refused (an existing one without ``force``,
        inside a store, at a link, at what the command reads).
    """
    if not heads:
        raise InvalidArgumentError("Expected at least one head (layer, head) to write an attention file of. Got none.")
    if not Path(folder).is_dir():
        raise InvalidArgumentError(f"Expected an existing folder for the attention files. Got {folder} "
                                   f"({'not a folder' if Path(folder).exists() else 'no such folder'}).")
    return [check_output(Path(folder) / attention_file_name(stem, layer, head), force=force, suffix=".json",
                         reads=reads) for layer, head in heads]


def attention_pages(engine: Any, prompt: str | Sequence[int], heads: Sequence[tuple[int, int]], folder: str | Path,
                    *, stem: str, query: int | None = None, tokens: Sequence[str] | None = None, neurons: int = 0,
                    force: bool = False, model: dict[str, Any] | None = None,
                    reads: Sequence[tuple[str, str | Path]] = (), progress: bool = True) -> list[Path]:
    """Write one ``detjac attention`` JSON per head into ``folder``, as ``STEM.qk.L{layer}.H{head}.json``.

    Parameters
    ----------
    engine
        An in-memory engine (:func:`~detjac.engine.load_engine`): loaded once, for every head.
    prompt
        Text or token ids.
    heads
        (layer, head) pairs, in the order they are computed (repeats computed once).
    folder
        An existing folder (the graph's, for ``detjac view`` to find the files beside it).
    stem
        The graph file's name without ``.json``.
    query
        The query position (negative: from the end); default the last.
    tokens
        The graph's tokens: the prompt's must be these (texts, in order), or nothing is written.
    neurons, model
        As :func:`~detjac.engine.qk_attribution`'s ``neurons`` and
        :meth:`~detjac.engine.tools.qk.QKAttribution.write`'s ``model``.
    force
        Replace existing files.
    reads
        What the caller reads, as :func:`~detjac.outputs.check_output`'s ``reads`` (the model, the graph).
    progress
        Show a progress bar over the heads.

    Returns
    -------
    list of Path
        The files written, in the heads' order.

    Raises
    ------
    InvalidArgumentError
        No heads, a missing folder, a file :func:`~detjac.outputs.check_output` refuses, a head or layer out of the
        model's range, a layer-streamed engine, or a prompt whose tokens are not ``tokens``: each before anything is
        written.
    UnsupportedModelError, PromptError, LinearizationError
        As :func:`~detjac.engine.qk_attribution`.
    """
    from detjac.engine import check_qk_request, qk_attribution

    heads = list(dict.fromkeys((int(layer), int(head)) for layer, head in heads))
    paths = attention_targets(folder, stem, heads, force=force, reads=reads)
    for layer, head in heads:
        check_qk_request(engine.model.config, layer, head, neurons)
    with tqdm(total=len(heads), desc="attention pages", unit="head", disable=not progress) as bar:
        for (layer, head), path in zip(heads, paths, strict=True):
            result = qk_attribution(engine, prompt, layer, head, query=query, neurons=neurons)
            if tokens is not None and result.tokens != list(tokens):
                raise InvalidArgumentError(
                    f"Expected the graph's prompt ({len(tokens)} tokens, {''.join(tokens)[:80]!r}) for its heads' "
                    f"attention files. Got {len(result.tokens)} tokens, {''.join(result.tokens)[:80]!r}.")
            result.write(path, force=force, model=model)
            bar.update(1)
    return paths
