"""The heads whose attention pages a graph asks for: its heads panel's first N rows (the graph page's ranking,
:func:`~detjac.view.graph_heads.head_ranking`), each at the graph's target position, with what writing their files
needs (the graph's prompt, its tokens, the files' stem). Torch-free: ``detjac attention --graph G --top-heads N``
reads this, then :func:`detjac.runs.attention_pages` computes every head in one model load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from ..safe_json import read_json
from .attention_file import prompt_text
from .graph_page import graph_payload


@dataclass(frozen=True)
class TopHeads:
    """What :func:`top_heads` read of a graph: ``heads`` ((layer, head), the heads panel's order), ``query`` (the
    target logits' position), ``prompt`` (its text, without a leading special token), ``tokens`` (every token's
    text, as the graph records them), ``stem`` (its file's name without ``.json``), ``ranked`` (the rows the panel
    has), ``info`` (the graph's ``metadata.info``: its model's name, weights' SHA-256, ...)."""

    heads: list[tuple[int, int]]
    query: int
    prompt: str
    tokens: list[str]
    stem: str
    ranked: int
    info: dict[str, Any]


def top_heads(path: str | Path, top: int) -> TopHeads:
    """The first ``top`` heads of the graph file ``path``'s heads panel (module docstring).

    Raises
    ------
    InvalidArgumentError
        ``top`` below 1; the file cannot be read as a graph JSON; a graph without logits or without head loadings
        (``detjac graph --heads N`` loads them), so that it ranks no head.
    """
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise InvalidArgumentError(f"Expected a number of heads of at least 1. Got {top!r}.")
    try:
        raw = read_json(path, kind="graph")
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"Expected a graph JSON file written by `detjac graph`. Got {path}, which cannot "
                                   f"be read as JSON ({exc}).") from exc
    page = graph_payload(raw, str(path))
    rows = page["metadata"]["heads"]["rows"]
    logit = next((n for n in page["nodes"] if n["type"] == "logit"), None)
    if logit is None or not rows:
        got = "no logit" if logit is None else f"no head loadings on its {len(page['links'])} links"
        raise InvalidArgumentError(f"Expected a graph that ranks its heads (logits, and head loadings: `detjac graph "
                                   f"--heads N`) in {path}. Got {got}.")
    info: dict[str, Any] = page["metadata"]["info"]
    return TopHeads([(int(r["layer"]), int(r["head"])) for r in rows[:top]], int(logit["ctx"]), prompt_text(page),
                      list(page["metadata"]["prompt_tokens"]), Path(path).stem, len(rows), info)
