"""The heads whose attention pages a graph asks for: the first N of its heads panel, ranked by their exact direct
effect on the graph's first target (``effect``, :func:`~detjac.view.graph_heads.head_effect_rows`: every head of the
model, largest ``|effect|`` first) or by the share of the top logit they carry through the loaded links (``share``,
:func:`~detjac.view.graph_heads.head_ranking`: graphs with head loadings), each at the graph's target position,
with what writing their files needs (the graph's prompt, its tokens, the files' stem). Torch-free: ``detjac attention
--graph G --top-heads N`` reads this, then :func:`detjac.runs.attention_pages` computes every head in one model load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from ..graph_settings import HEAD_RANKINGS
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


def top_heads(path: str | Path, top: int, by: str = "effect") -> TopHeads:
    """The first ``top`` heads of the graph file ``path``'s heads panel, ranked ``by`` (module docstring).

    Raises
    ------
    InvalidArgumentError
        ``top`` below 1 or an unknown ranking; the file cannot be read as a graph JSON; a graph without logits, or
        that does not rank its heads that way (no direct effects: a graph written by an older detjac; no head
        loadings: ``detjac graph --heads N`` loads them).
    """
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise InvalidArgumentError(f"Expected a number of heads of at least 1. Got {top!r}.")
    if by not in HEAD_RANKINGS:
        raise InvalidArgumentError(f"Expected a ranking of heads among {', '.join(HEAD_RANKINGS)}. Got {by!r}.")
    try:
        raw = read_json(path, kind="graph")
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"Expected a graph JSON file written by `detjac graph`. Got {path}, which cannot "
                                   f"be read as JSON ({exc}).") from exc
    page = graph_payload(raw, str(path))
    heads = page["metadata"]["heads"]
    effects = heads.get("effects")
    rows = heads["rows"] if by == "share" else effects["rows"] if effects else []  # each already in its order
    logit = next((n for n in page["nodes"] if n["type"] == "logit"), None)
    if logit is None or not rows:
        got = "no logit" if logit is None else f"no head loadings on its {len(page['links'])} links" if \
            by == "share" else "no direct effects of heads (a graph written before them: --heads-by share ranks by " \
                               "head loadings)"
        needs = "head loadings: `detjac graph --heads N`" if by == "share" else "the heads' direct effects"
        raise InvalidArgumentError(f"Expected a graph that ranks its heads (logits, and {needs}) in {path}. Got "
                                   f"{got}.")
    info: dict[str, Any] = page["metadata"]["info"]
    return TopHeads([(int(r["layer"]), int(r["head"])) for r in rows[:top]], int(logit["ctx"]), prompt_text(page),
                      list(page["metadata"]["prompt_tokens"]), Path(path).stem, len(rows), info)
